//! The replenishment strategies as arithmetic: how many VMs a pool needs, and how many it has
//! too many, from its counts (reference-behaviour §4.2).
//!
//! Pure: no I/O, no database rows, no clock. The pass (`provision`, `sweeps`) and
//! `poolmgr-check` (which checks a pool settled where its strategy says) both decide with
//! these, from the [`VmCounts`] the store's one SQL definition counts, so what "full" means
//! is written once.

use crate::domain::{Strategy, VmCounts};

/// How many VMs a pool needs now: what its strategy wants ([`strategy_wants`]), or none
/// while its quarantined VMs fill it ([`quarantine_full`]).
pub fn desired_new(strategy: Strategy, size: i32, min_size: Option<i32>, c: VmCounts) -> i64 {
    if quarantine_full(size, c) { 0 } else { strategy_wants(strategy, size, min_size, c) }
}

/// Whether a pool's QUARANTINED VMs number at least its size: it is then not replenished at
/// all until an operator discards some (`DELETE /v1/vms/{id}`) or raises the size. Without
/// this bound a pool whose hook always fails under QUARANTINE got a replacement for every
/// failure, every pass, until its hosts ran out of memory (issue 14 item 5). Quarantined VMs
/// are kept for inspection, so the bound lets a pool hold at most about twice its size.
pub fn quarantine_full(size: i32, c: VmCounts) -> bool {
    size > 0 && c.quarantined >= i64::from(size)
}

/// How many VMs a pool's strategy wants now, whatever holds it back. DELETING, FAILED and
/// QUARANTINED VMs never count, so a replacement starts before an old VM's delete finishes.
/// A fresh pool is topped up to `size` by every strategy (MIN_SIZE_THRESHOLD: because 0
/// available is below min_size).
pub fn strategy_wants(strategy: Strategy, size: i32, min_size: Option<i32>, c: VmCounts) -> i64 {
    let size = i64::from(size);
    match strategy {
        // Leased VMs are extra: the pool keeps `size` ready or coming.
        Strategy::ImmediateOnLease => (size - (c.available + c.claiming + c.provisioning)).max(0),
        Strategy::MinSizeThreshold => {
            if c.available >= i64::from(min_size.unwrap_or(1)) {
                0
            } else {
                (size - (c.available + c.claiming + c.leased + c.provisioning)).max(0)
            }
        }
        // Leased VMs count: a VM is replaced only once it is gone.
        Strategy::ReplaceOnDelete => (size - (c.available + c.claiming + c.leased + c.provisioning)).max(0),
    }
}

/// What the strategy wants, within an autoscaled pool's ceiling (`None`: no ceiling).
pub fn wants_within(wants: i64, ceiling: Option<i32>, c: VmCounts) -> i64 {
    match ceiling {
        Some(max) => wants.min(ceiling_room(max, c)),
        None => wants,
    }
}

/// How many more VMs an autoscaled pool may have under its ceiling of `max`, which counts
/// every VM of the pool (available, being claimed, leased, provisioning).
pub fn ceiling_room(max: i32, c: VmCounts) -> i64 {
    (i64::from(max) - (c.available + c.claiming + c.leased + c.provisioning)).max(0)
}

/// How many AVAILABLE VMs a pool has beyond what its strategy keeps (after its size went
/// down). Only AVAILABLE VMs are ever removed for this; leased ones wind down by release, and
/// VMs still PROVISIONING are not counted here: a ready VM is never shed for one still booting.
/// Counted, a pool whose size fell right after a burst's claims had their replacements
/// created shed the VMs that were up and kept the booting ones, and the next claims found
/// none (the demand benchmark's announced day with a minute's lead, docs/benchmarks.md,
/// session 20); booting VMs beyond the size are shed as they come up, and none is replaced
/// meanwhile (the size counts them).
pub fn surplus(strategy: Strategy, size: i32, c: VmCounts) -> i64 {
    let ready = match strategy {
        Strategy::ImmediateOnLease => c.available + c.claiming,
        Strategy::MinSizeThreshold | Strategy::ReplaceOnDelete => c.available + c.claiming + c.leased,
    };
    (ready - i64::from(size)).clamp(0, c.available)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(available: i64, claiming: i64, leased: i64, provisioning: i64) -> VmCounts {
        VmCounts { available, claiming, leased, provisioning, ..VmCounts::default() }
    }

    #[test]
    fn immediate_on_lease_keeps_size_ready_and_ignores_leased() {
        assert_eq!(desired_new(Strategy::ImmediateOnLease, 5, None, c(0, 0, 0, 0)), 5);
        assert_eq!(desired_new(Strategy::ImmediateOnLease, 5, None, c(3, 0, 2, 0)), 2);
        assert_eq!(desired_new(Strategy::ImmediateOnLease, 5, None, c(3, 1, 9, 1)), 0);
        assert_eq!(desired_new(Strategy::ImmediateOnLease, 5, None, c(6, 0, 0, 0)), 0);
    }

    #[test]
    fn replace_on_delete_counts_leased_vms() {
        assert_eq!(desired_new(Strategy::ReplaceOnDelete, 5, None, c(0, 0, 0, 0)), 5);
        assert_eq!(desired_new(Strategy::ReplaceOnDelete, 5, None, c(3, 0, 2, 0)), 0);
        assert_eq!(desired_new(Strategy::ReplaceOnDelete, 5, None, c(2, 1, 1, 0)), 1);
    }

    #[test]
    fn min_size_threshold_acts_only_below_min_size() {
        assert_eq!(desired_new(Strategy::MinSizeThreshold, 5, Some(2), c(0, 0, 0, 0)), 5);
        assert_eq!(desired_new(Strategy::MinSizeThreshold, 5, Some(2), c(2, 0, 0, 0)), 0);
        assert_eq!(desired_new(Strategy::MinSizeThreshold, 5, Some(2), c(1, 0, 3, 0)), 1);
        assert_eq!(desired_new(Strategy::MinSizeThreshold, 5, Some(2), c(1, 0, 1, 1)), 2);
    }

    /// Issue 14 item 5: quarantined VMs filling the pool stop replenishment; fewer do not.
    #[test]
    fn quarantined_vms_filling_the_pool_stop_replenishment() {
        let q = |quarantined, available| VmCounts { quarantined, available, ..VmCounts::default() };
        for strategy in Strategy::ALL {
            assert_eq!(desired_new(*strategy, 3, Some(1), q(3, 0)), 0, "{strategy}");
            assert_eq!(desired_new(*strategy, 3, Some(1), q(7, 0)), 0, "{strategy}");
            assert_eq!(strategy_wants(*strategy, 3, Some(1), q(3, 0)), 3, "{strategy}: still wanted");
            assert_eq!(desired_new(*strategy, 3, Some(1), q(2, 0)), 3, "{strategy}: below the bound");
        }
        assert!(quarantine_full(2, q(2, 0)));
        assert!(!quarantine_full(2, q(1, 5)));
        assert!(!quarantine_full(0, q(0, 0)), "an empty pool is not held back");
    }

    #[test]
    fn the_ceiling_counts_every_vm_of_the_pool() {
        assert_eq!(ceiling_room(10, c(2, 1, 3, 2)), 2);
        assert_eq!(ceiling_room(10, c(2, 1, 9, 2)), 0, "never negative");
        assert_eq!(ceiling_room(10, VmCounts { quarantined: 5, deleting: 5, ..VmCounts::default() }), 10);
    }

    #[test]
    fn surplus_only_counts_available_vms_beyond_size() {
        assert_eq!(surplus(Strategy::ReplaceOnDelete, 1, c(3, 0, 0, 0)), 2);
        assert_eq!(surplus(Strategy::ReplaceOnDelete, 1, c(1, 0, 3, 0)), 1, "leased VMs are never removed");
        assert_eq!(surplus(Strategy::ReplaceOnDelete, 5, c(3, 0, 2, 0)), 0);
        assert_eq!(surplus(Strategy::ImmediateOnLease, 2, c(3, 0, 5, 0)), 1, "leased VMs are extra");
        assert_eq!(surplus(Strategy::MinSizeThreshold, 0, c(2, 1, 0, 1)), 2);
        // A size that fell while VMs boot: the ready ones stay, the booting ones beyond the
        // size go as they come up.
        assert_eq!(surplus(Strategy::ImmediateOnLease, 63, c(51, 0, 35, 41)), 0, "51 ready of 63");
        assert_eq!(surplus(Strategy::ImmediateOnLease, 40, c(51, 0, 35, 41)), 11);
        assert_eq!(surplus(Strategy::ReplaceOnDelete, 5, c(3, 0, 2, 4)), 0);
        assert_eq!(surplus(Strategy::ReplaceOnDelete, 4, c(3, 0, 2, 4)), 1);
    }
}
