//! The history of what clients were told during a fault campaign (`scripts/chaos.sh
//! --campaign`, issue 23), and its checker: Jepsen's rule that what a client was *told*
//! matters as much as what the database holds.
//!
//! A history is one [`Op`] per request attempt, as JSON lines: a claim (with its
//! request_id), a heartbeat or a release, when it was invoked and when it completed (the
//! client's monotonic clock, seconds since the load started), and its outcome: `ok`
//! (acknowledged), `failed` (a definite answer that it did not happen: 4xx, 503, 429) or
//! `unknown` (timed out, connection lost: it may or may not have happened).
//!
//! [`check`] finds, without looking at the database:
//! - **a VM held by two leases**: a VM is used once, so two acknowledged leases naming one
//!   VM are an anomaly whatever their times;
//! - **a lost lease**: a heartbeat or a first release answered 404 while the lease must still
//!   have existed (less than its expiry after the last acknowledged claim or heartbeat began);
//! - **a request_id answered with two leases**: every acknowledged claim of one request_id
//!   names the lease its first acknowledged answer named, or a fresh one only once that lease
//!   could have ended (released, or past its expiry);
//! - **a dead VM handed out**: an acknowledged claim whose VM its flintlock host did not
//!   have when asked right after the answer (issue 23 finding 1);
//! - **an unresolved outcome**: a request_id (or a release) whose last attempt is unknown or
//!   failed, never followed by an acknowledged one.
//!
//! Never reads a clock itself, so a history checks the same way every time.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

/// What an attempt was told.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Ok,
    Failed,
    Unknown,
}

/// The kind of request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Claim,
    Heartbeat,
    Release,
    /// A GetMicroVM of an acknowledged claim's VM on its host, right after the answer:
    /// `failed` with status 404 when flintlock does not have it (a dead VM handed out).
    Verify,
}

/// One request attempt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Op {
    pub client: usize,
    pub kind: Kind,
    /// The claim's request_id (claims only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// The lease: answered by a claim, or the one a heartbeat or release names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_id: Option<String>,
    /// The VM an acknowledged claim answered with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm_id: Option<String>,
    /// Seconds since the load started, on the client's monotonic clock.
    pub invoked: f64,
    pub completed: f64,
    pub outcome: Outcome,
    /// The HTTP status, when one came back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// An acknowledged claim answered as a replay.
    #[serde(default)]
    pub replayed: bool,
    /// The endpoint it went to.
    #[serde(default)]
    pub endpoint: String,
}

/// One anomaly: a kind and what shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Anomaly {
    pub kind: &'static str,
    pub detail: String,
}

/// Operations by kind and outcome, for the campaign's report.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Tally {
    pub by_kind: BTreeMap<String, BTreeMap<String, u64>>,
}

impl Tally {
    pub fn of(history: &[Op]) -> Tally {
        let mut t = Tally::default();
        for op in history {
            let kind =
                serde_json::to_value(op.kind).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
            let outcome =
                serde_json::to_value(op.outcome).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
            *t.by_kind.entry(kind).or_default().entry(outcome).or_default() += 1;
        }
        t
    }
}

/// How long after a lease's last acknowledged claim or heartbeat *began* it must still exist:
/// the pool's heartbeat expiry, less a slack for the reconciler's and clocks' imprecision.
#[derive(Debug, Clone, Copy)]
pub struct Rules {
    pub lease_expiry_seconds: f64,
    pub slack_seconds: f64,
}

/// Checks a history (any order; sorted by invocation here). Returns every anomaly found.
pub fn check(history: &[Op], rules: Rules) -> Vec<Anomaly> {
    let mut ops: Vec<&Op> = history.iter().collect();
    ops.sort_by(|a, b| a.invoked.total_cmp(&b.invoked));
    let alive_for = (rules.lease_expiry_seconds - rules.slack_seconds).max(0.0);
    let mut anomalies = vec![];

    // Per lease: its VM, and the start of its last acknowledged claim or heartbeat.
    let mut vm_leases: HashMap<&str, Vec<&str>> = HashMap::new();
    let mut alive_since: HashMap<&str, f64> = HashMap::new();
    let mut released_at: HashMap<&str, f64> = HashMap::new();
    // Per request_id: the lease its first acknowledged answer named.
    let mut rid_lease: HashMap<&str, &str> = HashMap::new();
    // What each request_id's and release's last attempt was told (an unresolved outcome).
    let mut rid_last: HashMap<&str, &Op> = HashMap::new();
    let mut release_last: HashMap<&str, &Op> = HashMap::new();
    let mut release_attempts: HashMap<&str, u32> = HashMap::new();

    for op in &ops {
        match op.kind {
            Kind::Claim => {
                let Some(rid) = op.request_id.as_deref() else { continue };
                rid_last
                    .entry(rid)
                    .and_modify(|last| {
                        if last.outcome != Outcome::Ok {
                            *last = op
                        }
                    })
                    .or_insert(op);
                if op.outcome != Outcome::Ok {
                    continue;
                }
                let Some(lease) = op.lease_id.as_deref() else {
                    anomalies.push(Anomaly { kind: "claim-without-lease", detail: format!("{op:?}") });
                    continue;
                };
                match rid_lease.get(rid) {
                    None => {
                        rid_lease.insert(rid, lease);
                    }
                    Some(first) if *first == lease => {}
                    Some(first) => {
                        // A fresh lease is right only once the first could have ended.
                        let ended = released_at.get(first).is_some_and(|t| *t <= op.invoked)
                            || alive_since.get(first).is_none_or(|t| t + alive_for <= op.invoked);
                        if !ended {
                            anomalies.push(Anomaly {
                                kind: "request-id-two-leases",
                                detail: format!(
                                    "request_id {rid}: answered lease {lease} at {:.2}s while its first answer, lease {first}, was still live",
                                    op.completed
                                ),
                            });
                        }
                        rid_lease.insert(rid, lease);
                    }
                }
                if let Some(vm) = op.vm_id.as_deref() {
                    let leases = vm_leases.entry(vm).or_default();
                    if !leases.contains(&lease) {
                        leases.push(lease);
                    }
                }
                let since = alive_since.entry(lease).or_insert(op.invoked);
                *since = since.max(op.invoked);
            }
            Kind::Verify => {
                if op.status == Some(404) {
                    anomalies.push(Anomaly {
                        kind: "dead-vm",
                        detail: format!(
                            "lease {}: its VM {} is not on its flintlock host (asked at {:.2}s)",
                            op.lease_id.as_deref().unwrap_or("?"),
                            op.vm_id.as_deref().unwrap_or("?"),
                            op.invoked
                        ),
                    });
                }
            }
            Kind::Heartbeat | Kind::Release => {
                let Some(lease) = op.lease_id.as_deref() else { continue };
                // A release answered 404 is over too: after an attempt whose answer was lost,
                // that attempt did it; on the first attempt the lease was lost (checked below).
                let release_done = op.kind == Kind::Release && (op.outcome == Outcome::Ok || op.status == Some(404));
                if op.kind == Kind::Release {
                    *release_attempts.entry(lease).or_default() += 1;
                    release_last
                        .entry(lease)
                        .and_modify(|last| {
                            if !release_resolved(last) {
                                *last = op
                            }
                        })
                        .or_insert(op);
                }
                let first_release = op.kind == Kind::Release && release_attempts.get(lease) == Some(&1);
                let not_found = op.status == Some(404);
                if not_found && (op.kind == Kind::Heartbeat || first_release) {
                    let must_live_until = alive_since.get(lease).map(|t| t + alive_for);
                    let released = released_at.contains_key(lease);
                    if !released && must_live_until.is_some_and(|t| op.completed < t) {
                        anomalies.push(Anomaly {
                            kind: "lost-lease",
                            detail: format!(
                                "lease {lease}: {:?} answered 404 at {:.2}s; it was acknowledged alive at {:.2}s and expires {:.0}s later",
                                op.kind,
                                op.completed,
                                alive_since[lease],
                                rules.lease_expiry_seconds
                            ),
                        });
                    }
                }
                if op.kind == Kind::Heartbeat && op.outcome == Outcome::Ok {
                    let since = alive_since.entry(lease).or_insert(op.invoked);
                    *since = since.max(op.invoked);
                }
                if release_done {
                    released_at.entry(lease).or_insert(op.completed);
                }
            }
        }
    }
    for (vm, leases) in &vm_leases {
        if leases.len() > 1 {
            anomalies.push(Anomaly {
                kind: "vm-two-leases",
                detail: format!("vm {vm} was acknowledged to leases {}", leases.join(", ")),
            });
        }
    }
    let mut unresolved: Vec<_> = rid_last
        .iter()
        .filter(|(_, op)| op.outcome != Outcome::Ok)
        .map(|(rid, op)| {
            format!("claim {rid}: last told {:?} (HTTP {:?}) at {:.2}s", op.outcome, op.status, op.completed)
        })
        .chain(release_last.iter().filter(|(_, op)| !release_resolved(op)).map(|(lease, op)| {
            format!("release {lease}: last told {:?} (HTTP {:?}) at {:.2}s", op.outcome, op.status, op.completed)
        }))
        .collect();
    unresolved.sort();
    anomalies.extend(unresolved.into_iter().map(|detail| Anomaly { kind: "unresolved", detail }));
    anomalies
}

fn release_resolved(op: &Op) -> bool {
    op.outcome == Outcome::Ok || op.status == Some(404)
}

/// Reads a JSON-lines history.
pub fn parse(text: &str) -> Result<Vec<Op>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| serde_json::from_str(l).map_err(|e| format!("history line {}: {e}", i + 1)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULES: Rules = Rules { lease_expiry_seconds: 30.0, slack_seconds: 2.0 };

    fn claim(rid: &str, at: f64, outcome: Outcome, lease: Option<(&str, &str)>) -> Op {
        Op {
            client: 0,
            kind: Kind::Claim,
            request_id: Some(rid.into()),
            lease_id: lease.map(|(l, _)| l.into()),
            vm_id: lease.map(|(_, v)| v.into()),
            invoked: at,
            completed: at + 0.1,
            outcome,
            status: match outcome {
                Outcome::Ok => Some(200),
                Outcome::Failed => Some(503),
                Outcome::Unknown => None,
            },
            replayed: false,
            endpoint: String::new(),
        }
    }

    fn on_lease(kind: Kind, lease: &str, at: f64, status: Option<u16>) -> Op {
        let outcome = match status {
            Some(200 | 204) => Outcome::Ok,
            Some(_) => Outcome::Failed,
            None => Outcome::Unknown,
        };
        Op {
            client: 0,
            kind,
            request_id: None,
            lease_id: Some(lease.into()),
            vm_id: None,
            invoked: at,
            completed: at + 0.1,
            outcome,
            status,
            replayed: false,
            endpoint: String::new(),
        }
    }

    fn kinds(a: &[Anomaly]) -> Vec<&'static str> {
        a.iter().map(|a| a.kind).collect()
    }

    #[test]
    fn a_clean_history_has_no_anomaly() {
        let h = vec![
            claim("r1", 0.0, Outcome::Unknown, None),
            claim("r1", 1.0, Outcome::Ok, Some(("L1", "vm1"))),
            claim("r1", 2.0, Outcome::Ok, Some(("L1", "vm1"))),
            on_lease(Kind::Heartbeat, "L1", 3.0, Some(200)),
            on_lease(Kind::Release, "L1", 4.0, None),
            on_lease(Kind::Release, "L1", 5.0, Some(404)),
            // After the release, the id is free again: a fresh lease is right.
            claim("r1", 6.0, Outcome::Ok, Some(("L2", "vm2"))),
            on_lease(Kind::Release, "L2", 7.0, Some(204)),
        ];
        let _ = &h;
        // "Release L1" ended unknown then 404 on its retry: resolved, not a lost lease.
        assert_eq!(check(&h, RULES), vec![]);
    }

    /// Finding 1 as the campaign sees it would be a VM handed out twice, or one that vanished:
    /// two leases on one VM are caught whatever their times.
    #[test]
    fn a_vm_acknowledged_to_two_leases_is_an_anomaly() {
        let h =
            vec![claim("a", 0.0, Outcome::Ok, Some(("L1", "vm1"))), claim("b", 50.0, Outcome::Ok, Some(("L2", "vm1")))];
        assert_eq!(kinds(&check(&h, RULES)), ["vm-two-leases"]);
    }

    #[test]
    fn a_heartbeat_404_on_a_live_lease_is_a_lost_lease_and_after_its_expiry_is_not() {
        let h =
            vec![claim("a", 0.0, Outcome::Ok, Some(("L1", "vm1"))), on_lease(Kind::Heartbeat, "L1", 10.0, Some(404))];
        assert_eq!(kinds(&check(&h, RULES)), ["lost-lease"]);
        let h =
            vec![claim("a", 0.0, Outcome::Ok, Some(("L1", "vm1"))), on_lease(Kind::Heartbeat, "L1", 40.0, Some(404))];
        assert_eq!(check(&h, RULES), vec![], "expired while the client could not heartbeat: allowed");
        let h = vec![
            claim("a", 0.0, Outcome::Ok, Some(("L1", "vm1"))),
            on_lease(Kind::Heartbeat, "L1", 25.0, Some(200)),
            on_lease(Kind::Heartbeat, "L1", 40.0, Some(404)),
        ];
        assert_eq!(kinds(&check(&h, RULES)), ["lost-lease"], "the heartbeat at 25 s kept it alive");
    }

    #[test]
    fn a_first_release_answered_404_on_a_live_lease_is_a_lost_lease() {
        let h = vec![claim("a", 0.0, Outcome::Ok, Some(("L1", "vm1"))), on_lease(Kind::Release, "L1", 5.0, Some(404))];
        assert_eq!(kinds(&check(&h, RULES)), ["lost-lease"]);
    }

    #[test]
    fn a_retry_answered_with_another_lease_while_the_first_lives_is_an_anomaly() {
        let h =
            vec![claim("a", 0.0, Outcome::Ok, Some(("L1", "vm1"))), claim("a", 3.0, Outcome::Ok, Some(("L2", "vm2")))];
        assert_eq!(kinds(&check(&h, RULES)), ["request-id-two-leases"]);
        let h =
            vec![claim("a", 0.0, Outcome::Ok, Some(("L1", "vm1"))), claim("a", 45.0, Outcome::Ok, Some(("L2", "vm2")))];
        assert_eq!(check(&h, RULES), vec![], "the first lease could have expired");
    }

    #[test]
    fn an_unknown_or_failed_outcome_never_followed_by_an_ack_is_unresolved() {
        let h = vec![claim("a", 0.0, Outcome::Unknown, None), claim("b", 0.0, Outcome::Failed, None)];
        assert_eq!(kinds(&check(&h, RULES)), ["unresolved", "unresolved"]);
        let h = vec![claim("a", 0.0, Outcome::Ok, Some(("L1", "vm1"))), on_lease(Kind::Release, "L1", 1.0, None)];
        assert_eq!(kinds(&check(&h, RULES)), ["unresolved"], "a release never confirmed");
    }

    #[test]
    fn a_claimed_vm_its_host_does_not_have_is_a_dead_vm() {
        let mut verify = on_lease(Kind::Verify, "L1", 0.5, Some(404));
        verify.vm_id = Some("vm1".into());
        let h = vec![claim("a", 0.0, Outcome::Ok, Some(("L1", "vm1"))), verify.clone()];
        assert_eq!(kinds(&check(&h, RULES)), ["dead-vm"]);
        verify.status = Some(200);
        verify.outcome = Outcome::Ok;
        assert_eq!(check(&[claim("a", 0.0, Outcome::Ok, Some(("L1", "vm1"))), verify], RULES), vec![]);
    }

    #[test]
    fn histories_round_trip_as_json_lines() {
        let h = vec![claim("a", 0.0, Outcome::Ok, Some(("L1", "vm1"))), on_lease(Kind::Release, "L1", 1.0, Some(204))];
        let text: String = h.iter().map(|o| serde_json::to_string(o).unwrap() + "\n").collect();
        assert_eq!(parse(&text).unwrap(), h);
        let t = Tally::of(&h);
        assert_eq!(t.by_kind["claim"]["ok"], 1);
        assert_eq!(t.by_kind["release"]["ok"], 1);
    }
}
