//! Batches: claims that arrive all at once (a CI matrix fanning out 1 to 50 jobs), told
//! apart from a rate and sized for as an idle buffer (issue 22; docs/design-notes.md,
//! "Batches").
//!
//! A batch is served warm only if its n VMs are idle at its instant, and its instant is not
//! known in advance. A rate estimate cannot do that: it reads a served batch as more slots out
//! for a provisioning interval, grows the pool by the batch's size after the batch (when the
//! replacements of its claims are booting anyway, so the extra VMs arrive with them, too late
//! for it) and holds that for a stabilization window, while the next batch comes at any
//! moment. So batches are remembered (when, how large) for [`BATCH_MEMORY_WINDOWS`], confirmed
//! when the seconds after them held fewer arrivals (else they were a step's first seconds),
//! and while they keep coming (two or more confirmed) the pool keeps an idle buffer sized for them
//! ([`buffer`]): the smallest whose misses on the batches seen would stay within half of the
//! warm-hit target's allowance for all the claims of that time (a compound Poisson load).
//! The part of a batch the buffer served is taken out of the rate's windows, so it does not
//! also raise the size as a rate; the part it did not serve (refused requests, still
//! waiting) stays in them and grows the pool for them as before.
//!
//! Pure: no I/O, no clock, no rows; `scale` feeds it the last seconds' fresh arrivals.

use crate::domain::Batch;

use super::sizing::changed_tail;

/// How unlikely under the rate the last two slices' fresh arrivals must be to count as a
/// batch: a steady Poisson load almost never makes one (a decision every 2 s, ten hours at
/// 2 claims/s: none).
pub const BATCH_SIGNIFICANCE: f64 = 1e-6;
/// The smallest batch remembered: smaller ones are within any pool's slack.
pub const MIN_BATCH: i64 = 3;
/// How long batches are remembered, in demand windows (an hour of the default 60 s).
pub const BATCH_MEMORY_WINDOWS: f64 = 60.0;
/// At most this many batches remembered (the newest).
pub const MAX_BATCHES: usize = 64;
/// Batches have stopped coming once none came for this many of their mean gap (for Poisson
/// arrivals, that happens by chance 0.7 % of the time: e⁻⁵).
pub const KEEP_COMING_GAPS: f64 = 5.0;

/// The fresh arrivals of the last few seconds, per slice (oldest first; as
/// `store::PoolDemand`'s slices): each request once (a refused request's later claim is not
/// fresh), and of those the ones that took a VM at once; and when the last two slices'
/// arrivals came (their median, seconds; `None`: none came).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Recent {
    pub fresh: [i64; 4],
    pub served: [i64; 4],
    pub slice: f64,
    pub at: Option<f64>,
}

/// The batch in the last two slices, if any: their fresh arrivals above what the rate (per
/// second) expects, what the two slices before them held, and one arrival (a pool whose rate
/// reads 0 is not told a batch by its first few claims), when that many are significantly
/// unlikely ([`BATCH_SIGNIFICANCE`]) and at least [`MIN_BATCH`]. A step (arrivals that keep
/// coming) can look like one in its first seconds; [`record`] drops it when the slices after
/// it hold as many.
pub fn excess(r: &Recent, rate: f64) -> Option<i64> {
    let f = r.fresh.map(|n| n.max(0));
    let recent = f[2] + f[3];
    let base = (2.0 * rate.max(0.0) * r.slice).max(2.0 * f[0].max(f[1]) as f64).max(1.0);
    let e = (recent as f64 - base).floor() as i64;
    (e >= MIN_BATCH && changed_tail(recent, base, BATCH_SIGNIFICANCE, true)).then_some(e)
}

/// What one decision saw of a batch in the last two slices ([`record`]): its size if one is
/// there ([`excess`]), their claims served at once, the idle buffer the pool kept before it,
/// and whether a hint was live (the batch was announced).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Look {
    pub seen: Option<i64>,
    pub served: i64,
    pub buffer: i64,
    pub announced: bool,
}

/// The batches remembered after this decision: those of the last `memory` seconds (at most
/// [`MAX_BATCHES`]), with the one just seen (`look.seen`: its size) added at `r.at`, or merged into
/// the last one when that came within two slices (the same batch, seen again as the slices
/// move on). `buffer` is the idle buffer the pool kept before this batch: of the batch's
/// claims served at once (`served`), that many at most were the buffer's. A batch that came
/// while a hint was live (`announced`) is the hint's: all of it is covered (the hint's VMs
/// served it, not the buffer), and no buffer is kept for it.
///
/// A batch is confirmed once two slices have passed after it (slices that start half a slice
/// or more after its median arrival: its claims may straddle a slice's start), if those hold
/// fewer fresh arrivals than it did (pro rata: under half of it in two slices, under it in
/// four); else it was the first seconds of a step, and is dropped. Only confirmed batches that
/// were not announced make a buffer ([`buffer`]).
pub fn record(prev: &[Batch], now: f64, memory: f64, r: &Recent, look: Look) -> Vec<Batch> {
    let Look { seen, served, buffer, announced } = look;
    let slice = r.slice.max(1e-3);
    let f = r.fresh.map(|n| n.max(0));
    let mut out: Vec<Batch> = prev
        .iter()
        .copied()
        .filter(|b| b.at > now - memory && b.at <= now)
        .filter_map(|b| {
            // The slices that start half a slice or more after its median arrival: a batch's
            // claims come within a second, and can straddle two slices.
            let after = ((now - b.at - slice / 2.0) / slice).floor();
            if b.confirmed || after < 2.0 {
                return Some(b);
            }
            let k = after.min(4.0) as usize;
            let held: i64 = f[4 - k..].iter().sum();
            (held * 4 < i64::from(b.n) * k as i64).then_some(Batch { confirmed: true, ..b })
        })
        .collect();
    if let Some(n) = seen {
        let n = i32::try_from(n).unwrap_or(i32::MAX);
        let at = r.at.filter(|t| t.is_finite() && *t <= now).unwrap_or(now - slice);
        match out.last_mut() {
            Some(last) if !last.confirmed && last.at >= now - 2.0 * slice => {
                // Seen again: the later look holds more of it.
                (last.n, last.at) = (last.n.max(n), at.max(last.at));
                last.announced |= announced;
                let covered = i64::from(last.n).min(served).min(i64::from(last.buffer));
                last.covered =
                    if last.announced { last.n } else { last.covered.max(i32::try_from(covered).unwrap_or(0)) };
            }
            _ => {
                let buffer = i32::try_from(buffer.max(0)).unwrap_or(i32::MAX);
                let covered = if announced {
                    n
                } else {
                    i32::try_from(i64::from(n).min(served.max(0)).min(i64::from(buffer))).unwrap_or(0)
                };
                out.push(Batch { at, n, covered, buffer, confirmed: false, announced });
            }
        }
    }
    let extra = out.len().saturating_sub(MAX_BATCHES);
    out.drain(..extra);
    out
}

/// The batches' claims the buffer served within the last `span` seconds: taken out of the
/// rate's window of that span. A batch counts by its median arrival, so at a window's edge
/// it leaves the window at once where its claims leave over the seconds it took to arrive
/// (a matrix's claims come within a fraction of a second).
pub fn covered_within(batches: &[Batch], now: f64, span: f64) -> i64 {
    batches.iter().filter(|b| b.at >= now - span).map(|b| i64::from(b.covered)).sum()
}

/// The idle buffer at `now` for the batches remembered: none unless they keep coming (two or
/// more confirmed ones, the last within [`KEEP_COMING_GAPS`] of their mean gap); else the
/// smallest `b` whose misses on them are at most `allowance`. A batch of `n` above the buffer
/// misses `n − b` of its claims and takes every idle VM, so the claims of the provisioning
/// interval after it miss too: `load` of them (the rate times the mean provisioning time).
pub fn buffer(batches: &[Batch], now: f64, allowance: f64, load: f64) -> i64 {
    let batches: Vec<Batch> = batches.iter().copied().filter(|b| b.confirmed && !b.announced).collect();
    let (Some(first), Some(last)) = (batches.first(), batches.last()) else { return 0 };
    if batches.len() < 2 || now - last.at > KEEP_COMING_GAPS * (last.at - first.at) / (batches.len() - 1) as f64 {
        return 0;
    }
    let load = if load.is_finite() { load.max(0.0) } else { 0.0 };
    let misses =
        |b: i64| batches.iter().filter(|x| i64::from(x.n) > b).map(|x| (i64::from(x.n) - b) as f64 + load).sum::<f64>();
    let top = batches.iter().map(|x| i64::from(x.n)).max().unwrap_or(0);
    (0..=top).find(|b| misses(*b) <= allowance).unwrap_or(top)
}

/// The misses [`buffer`] leaves the batches: half of what `target_warm_ratio` allows all the
/// claims of the memory's `span` seconds at `rate` per second plus the batches' own (the other
/// half is the steady claims' Erlang loss).
pub fn allowance(target_warm_ratio: f64, rate: f64, span: f64, batches: &[Batch]) -> f64 {
    let batched: i64 = batches.iter().filter(|b| b.confirmed).map(|b| i64::from(b.n)).sum();
    (1.0 - target_warm_ratio).max(0.0) / 2.0 * (rate.max(0.0) * span.max(0.0) + batched as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recent(fresh: [i64; 4]) -> Recent {
        Recent { fresh, served: fresh, slice: 2.5, at: None }
    }

    fn look(seen: Option<i64>, served: i64, buffer: i64, announced: bool) -> Look {
        Look { seen, served, buffer, announced }
    }

    fn batch(at: f64, n: i32) -> Batch {
        Batch { at, n, covered: 0, buffer: 0, confirmed: true, announced: false }
    }

    #[test]
    fn a_batch_is_what_the_rate_and_the_slices_before_do_not_explain() {
        // 50 at once on 0.5 claims/s, in one slice or split across two.
        assert_eq!(excess(&recent([1, 0, 0, 50]), 0.5), Some(47));
        assert_eq!(excess(&recent([1, 2, 30, 21]), 0.5), Some(47));
        // Seen again two slices on: the slices before it now hold it.
        assert_eq!(excess(&recent([0, 50, 1, 0]), 0.5), None);
        // A steady 2 claims/s (5 a slice), however it wobbles within reason.
        assert_eq!(excess(&recent([5, 3, 9, 8]), 2.0), None);
        assert_eq!(excess(&recent([2, 4, 12, 10]), 2.0), None);
        // Too small to matter, or not unlikely enough, also when the rate reads 0.
        assert_eq!(excess(&recent([0, 0, 1, 1]), 0.02), None);
        assert_eq!(excess(&recent([0, 0, 0, 3]), 0.5), None);
        assert_eq!(excess(&recent([0, 0, 0, 5]), 0.0), None);
        assert_eq!(excess(&recent([0, 0, 0, 12]), 0.0), Some(11));
        // A step's slices after its first ones hold as many.
        assert_eq!(excess(&recent([0, 5, 5, 5]), 0.02), None);
    }

    #[test]
    fn a_batch_seen_again_is_merged_confirmed_when_what_follows_is_less_and_forgotten_later() {
        let at = |t: f64, fresh: [i64; 4]| Recent { at: Some(t), ..recent(fresh) };
        let b = record(&[], 100.0, 3600.0, &at(99.5, [0, 0, 0, 30]), look(Some(30), 30, 40, false));
        assert_eq!(b, vec![Batch { at: 99.5, n: 30, covered: 30, buffer: 40, confirmed: false, announced: false }]);
        let b = record(&b, 102.0, 3600.0, &at(99.6, [0, 0, 30, 15]), look(Some(45), 42, 99, false));
        assert_eq!(
            b,
            vec![Batch { at: 99.6, n: 45, covered: 40, buffer: 40, confirmed: false, announced: false }],
            "one batch, seen whole; the buffer before it served 40"
        );
        // Its claims straddle a slice's start (100 s): the 25 after it are its own, not what
        // followed it, so it is not judged on them.
        let straddled = record(&b, 105.0, 3600.0, &recent([0, 20, 25, 2]), look(None, 0, 45, false));
        assert_eq!(straddled, b, "not judged yet");
        // Two slices after the one that ends its claims, the slices after hold 3: a batch.
        let b = record(&straddled, 107.5, 3600.0, &recent([20, 25, 1, 2]), look(None, 0, 45, false));
        assert!(b[0].confirmed, "{b:?}");
        // A new one, refused, that turns out to be a step's first seconds: dropped.
        let b = record(&b, 110.0, 3600.0, &at(109.0, [0, 0, 0, 10]), look(Some(10), 0, 5, false));
        assert_eq!(b.len(), 2, "{b:?}");
        assert_eq!((b[1].n, b[1].covered, b[1].confirmed), (10, 0, false));
        assert_eq!(
            record(&b, 116.0, 3600.0, &recent([10, 5, 5, 6]), look(None, 0, 0, false)).len(),
            1,
            "the step goes on"
        );
        // Four slices on, all four are after it.
        assert!(record(&b, 121.0, 3600.0, &recent([2, 2, 3, 2]), look(None, 0, 0, false))[1].confirmed);
        assert_eq!(record(&b, 121.0, 3600.0, &recent([3, 3, 3, 2]), look(None, 0, 0, false)).len(), 1);
        // One that comes while a hint is live was announced: all of it is the hint's, and the
        // buffer is not kept for it.
        let hinted = record(&[], 100.0, 3600.0, &at(99.5, [0, 0, 0, 30]), look(Some(30), 12, 5, true));
        assert_eq!((hinted[0].covered, hinted[0].announced), (30, true));
        let merged = record(&[], 100.0, 3600.0, &at(99.5, [0, 0, 0, 30]), look(Some(30), 12, 5, false));
        let merged = record(&merged, 102.0, 3600.0, &at(99.6, [0, 0, 30, 15]), look(Some(45), 42, 5, true));
        assert_eq!((merged[0].n, merged[0].covered, merged[0].announced), (45, 45, true), "seen again under a hint");
        assert_eq!(
            record(&b, 3700.0, 3600.0, &recent([0; 4]), look(None, 0, 0, false)).len(),
            1,
            "the first one is past the memory"
        );
        let many: Vec<Batch> = (0..100).map(|i| batch(f64::from(i), 5)).collect();
        let kept = record(&many, 100.0, 3600.0, &recent([0; 4]), look(None, 0, 0, false));
        assert_eq!((kept.len(), kept[0].at), (MAX_BATCHES, 36.0), "the newest kept");
        assert_eq!(covered_within(&b, 110.0, 60.0), 40);
        assert_eq!(covered_within(&b, 110.0, 5.0), 0);
        assert_eq!(covered_within(&b, 160.0, 60.4), 40, "by its median arrival");
        assert_eq!(covered_within(&b, 160.0, 60.3), 0);
    }

    #[test]
    fn the_buffer_covers_the_batches_within_the_allowance_while_they_keep_coming() {
        assert_eq!(buffer(&[batch(0.0, 50)], 10.0, 0.0, 0.0), 0, "one batch is not batches that keep coming");
        // Every 300 s, the last at 1200 s.
        let seen: Vec<Batch> =
            [12, 45, 30, 7, 22].iter().zip(0..).map(|(n, i)| batch(f64::from(i) * 300.0, *n)).collect();
        assert_eq!(buffer(&seen, 1300.0, 0.0, 0.0), 45);
        // Five misses allowed: 45 - 40 = 5.
        assert_eq!(buffer(&seen, 1300.0, 5.0, 0.0), 40);
        assert_eq!(buffer(&seen, 1300.0, 1000.0, 0.0), 0);
        // They stopped: none for five mean gaps (1500 s).
        assert_eq!(buffer(&seen, 2699.0, 0.0, 0.0), 45);
        assert_eq!(buffer(&seen, 2701.0, 0.0, 0.0), 0);
        assert_eq!(buffer(&[], 0.0, 0.0, 0.0), 0);
        // Not confirmed yet, or announced by a hint: not counted.
        let mut open = seen.clone();
        open[1].confirmed = false;
        assert_eq!(buffer(&open, 1300.0, 0.0, 0.0), 30);
        let mut hinted = seen.clone();
        hinted[1].announced = true;
        assert_eq!(buffer(&hinted, 1300.0, 0.0, 0.0), 30);
        // The model day's matrix hours: 0.5 claims/s over an hour and these batches, 99 %.
        let a = allowance(0.99, 0.5, 3600.0, &seen);
        assert!((a - 0.005 * (1800.0 + 116.0)).abs() < 1e-9, "{a}");
        assert_eq!(buffer(&seen, 1300.0, a, 0.0), 36);
        // A batch above the buffer drains the pool: the rate's claims of the provisioning
        // interval after it (0.5 claims/s × 31 s) miss too, so a miss costs more than the
        // allowance and the buffer covers the largest batch …
        assert_eq!(buffer(&seen, 1300.0, a, 15.5), 45);
        // … unless the allowance takes one: 45 − 31 + 15.5 = 29.5 ≤ 30 < 45 − 30 + 15.5.
        assert_eq!(buffer(&seen, 1300.0, 30.0, 15.5), 31);
    }
}
