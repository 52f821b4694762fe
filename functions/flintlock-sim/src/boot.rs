//! How long a created VM stays PENDING before it is CREATED: one fixed delay (the default,
//! `--boot-delay-ms`), or a distribution drawn from once per VM (`--boot-delay-dist`), so a
//! benchmark sees boot times that vary the way real ones do.
//!
//! Never draws below zero or above [`MAX_BOOT_MS`]: a draw is clamped, so a heavy tail cannot
//! park a VM in PENDING for hours.

use std::fmt;
use std::time::Duration;

use rand::RngExt;

/// The longest boot any draw gives (one hour).
pub const MAX_BOOT_MS: f64 = 3_600_000.0;

/// A boot-time distribution.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BootDelay {
    /// Always the same delay.
    Fixed(Duration),
    /// Log-normal with the given median (ms) and σ of the underlying normal: a draw is
    /// `median · e^(σ·Z)`, Z standard normal.
    LogNormal { median_ms: f64, sigma: f64 },
    /// Uniform between the two bounds (ms, inclusive).
    Uniform { min_ms: u64, max_ms: u64 },
}

impl BootDelay {
    /// Parses `lognormal:MEDIAN_MS:SIGMA`, `uniform:MIN_MS:MAX_MS` or `fixed:MS`.
    pub fn parse(s: &str) -> Result<BootDelay, String> {
        let parts: Vec<&str> = s.split(':').collect();
        let num = |v: &str, what: &str| -> Result<f64, String> {
            match v.trim().parse::<f64>() {
                Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
                _ => Err(format!("{s:?}: {what} must be a number ≥ 0, got {v:?}")),
            }
        };
        let whole = |v: &str, what: &str| -> Result<u64, String> {
            v.trim().parse::<u64>().map_err(|_| format!("{s:?}: {what} must be a whole number of ms, got {v:?}"))
        };
        match parts.as_slice() {
            ["lognormal", median, sigma] => {
                let median_ms = num(median, "MEDIAN_MS")?;
                let sigma = num(sigma, "SIGMA")?;
                if median_ms <= 0.0 {
                    return Err(format!("{s:?}: MEDIAN_MS must be above 0"));
                }
                Ok(BootDelay::LogNormal { median_ms, sigma })
            }
            ["uniform", min, max] => {
                let (min_ms, max_ms) = (whole(min, "MIN_MS")?, whole(max, "MAX_MS")?);
                if min_ms > max_ms {
                    return Err(format!("{s:?}: MIN_MS is above MAX_MS"));
                }
                Ok(BootDelay::Uniform { min_ms, max_ms })
            }
            ["fixed", ms] => Ok(BootDelay::Fixed(Duration::from_millis(whole(ms, "MS")?))),
            _ => Err(format!("{s:?}: expected lognormal:MEDIAN_MS:SIGMA, uniform:MIN_MS:MAX_MS or fixed:MS")),
        }
    }

    /// One draw.
    pub fn sample(&self, rng: &mut impl RngExt) -> Duration {
        let ms = match *self {
            BootDelay::Fixed(d) => return d,
            BootDelay::LogNormal { median_ms, sigma } => median_ms * (sigma * standard_normal(rng)).exp(),
            BootDelay::Uniform { min_ms, max_ms } => rng.random_range(min_ms..=max_ms) as f64,
        };
        Duration::from_secs_f64(ms.clamp(0.0, MAX_BOOT_MS) / 1000.0)
    }

    /// The distribution's median.
    pub fn median(&self) -> Duration {
        match *self {
            BootDelay::Fixed(d) => d,
            BootDelay::LogNormal { median_ms, .. } => Duration::from_secs_f64(median_ms / 1000.0),
            BootDelay::Uniform { min_ms, max_ms } => Duration::from_secs_f64((min_ms + max_ms) as f64 / 2000.0),
        }
    }
}

impl fmt::Display for BootDelay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BootDelay::Fixed(d) => write!(f, "fixed:{}", d.as_millis()),
            BootDelay::LogNormal { median_ms, sigma } => write!(f, "lognormal:{median_ms}:{sigma}"),
            BootDelay::Uniform { min_ms, max_ms } => write!(f, "uniform:{min_ms}:{max_ms}"),
        }
    }
}

/// A standard normal draw (Box–Muller; `1 - u` keeps the logarithm's argument above 0).
fn standard_normal(rng: &mut impl RngExt) -> f64 {
    let u1: f64 = 1.0 - rng.random::<f64>();
    let u2: f64 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn parses_each_distribution_and_refuses_bad_ones() {
        assert_eq!(
            BootDelay::parse("lognormal:30000:0.25"),
            Ok(BootDelay::LogNormal { median_ms: 30000.0, sigma: 0.25 })
        );
        assert_eq!(BootDelay::parse("uniform:100:250"), Ok(BootDelay::Uniform { min_ms: 100, max_ms: 250 }));
        assert_eq!(BootDelay::parse("fixed:40"), Ok(BootDelay::Fixed(Duration::from_millis(40))));
        for bad in [
            "",
            "lognormal",
            "lognormal:30000",
            "lognormal:0:1",
            "lognormal:-5:1",
            "lognormal:100:x",
            "lognormal:100:1:2",
            "uniform:250:100",
            "uniform:1.5:3",
            "normal:1:2",
            "fixed:-1",
        ] {
            assert!(BootDelay::parse(bad).is_err(), "{bad:?} must be refused");
        }
        // What Display prints parses back to the same distribution.
        for d in ["lognormal:250:0.3", "uniform:5:9", "fixed:7"] {
            assert_eq!(BootDelay::parse(d).unwrap().to_string(), d);
        }
    }

    #[test]
    fn draws_follow_the_distribution() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let u = BootDelay::Uniform { min_ms: 100, max_ms: 200 };
        let draws: Vec<u128> = (0..2000).map(|_| u.sample(&mut rng).as_millis()).collect();
        assert!(draws.iter().all(|d| (100..=200).contains(d)), "uniform draws stay within the bounds");
        assert_eq!((draws.iter().min(), draws.iter().max()), (Some(&100), Some(&200)), "and reach both");

        let l = BootDelay::LogNormal { median_ms: 1000.0, sigma: 0.5 };
        let mut ms: Vec<f64> = (0..4001).map(|_| l.sample(&mut rng).as_secs_f64() * 1000.0).collect();
        ms.sort_by(f64::total_cmp);
        let median = ms[2000];
        assert!((900.0..1100.0).contains(&median), "median of 4001 draws {median} is near 1000");
        // e^(0.5 · 1.2816) = 1.90: a tenth of the draws lie above 1.9 s.
        let above = ms.iter().filter(|&&m| m > 1896.0).count() as f64 / ms.len() as f64;
        assert!((0.08..0.12).contains(&above), "{above} of the draws above the 90th percentile");
        assert_eq!(l.median(), Duration::from_secs(1));

        let f = BootDelay::Fixed(Duration::from_millis(3));
        assert_eq!(f.sample(&mut rng), Duration::from_millis(3));
    }
}
