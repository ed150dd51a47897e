//! Naming the one tensor in which two replicas differ, from two numbers a replica.
//!
//! Each replica sends its fingerprint D = Σ S_i·(2i+1) and locator L = Σ S_i·(2i+1)², both
//! mod 2^52, S_i the wrapping sum of tensor i's raw words (the SDK's `fingerprint.py`). When
//! two replicas differ in tensor j only, by δ = S_j − S'_j, then ΔD = δ·(2j+1) and ΔL =
//! δ·(2j+1)² (mod 2^52), so 2j+1 = ΔL/ΔD — a single-error-locating code, as a Reed–Solomon
//! syndrome locates an error. Division modulo 2^52 needs care: δ is an odd multiple of 2^b, so
//! both differences are divided by 2^b first and the odd rest inverted, which leaves 2j+1 known
//! modulo 2^(52−b). A word is at most 32 bits, so b < 32 and that is at least 2^21: positions
//! below 2^20 are told apart.
//!
//! The answer is checked before it is believed: δ = ΔD/(2j+1) must be a change one tensor's
//! word-wide sum can make (|δ| < 2^33) and δ·(2j+1)² must give ΔL back. Differences spread over
//! several tensors pass both only by chance (below 2^-19 per comparison): they are reported as
//! not locatable, and the blocks' digests say where instead.

/// The digests' modulus is 2^`BITS`.
const BITS: u32 = 52;
const MASK: u64 = (1 << BITS) - 1;
/// The largest change of one tensor's sum: the difference of two signed 32-bit words' sums.
const MAX_DELTA: i64 = 1 << 33;

/// x⁻¹ mod 2^64 for odd `x` (Newton's iteration: each round doubles the correct low bits).
fn inverse_odd(x: u64) -> u64 {
    debug_assert!(x & 1 == 1);
    let mut inv = x; // correct to 3 bits for odd x
    for _ in 0..5 {
        inv = inv.wrapping_mul(2u64.wrapping_sub(x.wrapping_mul(inv)));
    }
    inv
}

/// The signed value of `x` mod 2^52, in (−2^51, 2^51].
fn signed(x: u64) -> i64 {
    let x = x & MASK;
    if x > MASK >> 1 {
        x as i64 - (1i64 << BITS)
    } else {
        x as i64
    }
}

/// The position j (`< tensors`) of the one tensor in which two replicas differ, from their
/// digests' and locators' differences (each as the integer the f64 holds: below 2^52); `None`
/// when they do not differ, or differ in more than one tensor, or the position is ambiguous.
pub fn locate(digest_delta: u64, locator_delta: u64, tensors: usize) -> Option<usize> {
    let (dd, dl) = (digest_delta & MASK, locator_delta & MASK);
    if dd == 0 {
        return None;
    }
    let b = dd.trailing_zeros();
    if dl == 0 || dl.trailing_zeros() < b {
        return None;
    }
    let bits = BITS - b;
    let low = (1u64 << bits) - 1;
    let odd = ((dl >> b).wrapping_mul(inverse_odd(dd >> b))) & low;
    // 2j+1 is known modulo 2^bits: it must be odd, and only one candidate below 2·tensors.
    if odd & 1 == 0 || (tensors as u64).saturating_mul(2) > low {
        return None;
    }
    let j = (odd >> 1) as usize;
    if j >= tensors {
        return None;
    }
    let weight = 2 * j as u64 + 1;
    let delta = signed(dd.wrapping_mul(inverse_odd(weight)));
    let fits = delta != 0 && delta.abs() < MAX_DELTA;
    let back = (delta as u64).wrapping_mul(weight).wrapping_mul(weight) & MASK;
    (fits && back == dl).then_some(j)
}

/// The fingerprint D and locator L of a replica whose tensors' word sums are `sums`, as the
/// SDK forms them (integers below 2^52): the definition any client reproduces.
pub fn digests(sums: &[i64]) -> (u64, u64) {
    let (mut d, mut l) = (0u64, 0u64);
    for (i, &s) in sums.iter().enumerate() {
        let w = 2 * i as u64 + 1;
        d = d.wrapping_add((s as u64).wrapping_mul(w));
        l = l.wrapping_add((s as u64).wrapping_mul(w).wrapping_mul(w));
    }
    (d & MASK, l & MASK)
}

/// `a − b` of two digests as they travel (integers below 2^52 in an f64), mod 2^52.
pub fn digest_delta(a: f64, b: f64) -> u64 {
    (a as u64).wrapping_sub(b as u64) & MASK
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The change a flip of `bit` makes to a signed `width`-bit wrapping sum `sum`.
    fn flipped(sum: i64, bit: u32, width: u32, up: bool) -> i64 {
        let half = 1i64 << (width - 1);
        let raw = if up {
            sum + (1 << bit)
        } else {
            sum - (1 << bit)
        };
        (raw + half).rem_euclid(2 * half) - half
    }

    #[test]
    fn inverses_are_inverses() {
        for x in [1u64, 3, 5, 0xdead_beef | 1, u64::MAX] {
            assert_eq!(x.wrapping_mul(inverse_odd(x)), 1, "{x}");
        }
    }

    proptest! {
        /// Every single-bit change of one tensor's word-wide sum, in every bit of 8-, 16- and
        /// 32-bit words, wrapping or not, at any position of a model of up to 5,000 tensors:
        /// located exactly.
        #[test]
        fn one_changed_tensor_is_located(
            seed_sums in prop::collection::vec(-(1i64 << 31)..(1i64 << 31), 1..60),
            extra in 0usize..5000,
            pick in any::<prop::sample::Index>(),
            width in prop::sample::select(vec![8u32, 16, 32]),
            bit_pick in any::<prop::sample::Index>(),
            up in any::<bool>(),
        ) {
            let half = 1i64 << (width - 1);
            let mut sums: Vec<i64> = seed_sums.iter().map(|s| s.rem_euclid(2 * half) - half).collect();
            sums.resize(seed_sums.len() + extra, 7);
            let j = pick.index(sums.len());
            let bit = bit_pick.index(width as usize) as u32;
            let before = digests(&sums);
            sums[j] = flipped(sums[j], bit, width, up);
            let after = digests(&sums);
            prop_assert_ne!(before.0, after.0);
            let (dd, dl) = (after.0.wrapping_sub(before.0), after.1.wrapping_sub(before.1));
            prop_assert_eq!(locate(dd, dl, sums.len()), Some(j));
            // Either way round: the minority is the left side or the right.
            let (dd, dl) = (before.0.wrapping_sub(after.0), before.1.wrapping_sub(after.1));
            prop_assert_eq!(locate(dd, dl, sums.len()), Some(j));
        }

        /// Changes in many tensors (a skipped step, another checkpoint) are never named as one.
        #[test]
        fn changes_in_several_tensors_are_not_located(
            sums in prop::collection::vec(-(1i64 << 31)..(1i64 << 31), 3..200),
            changes in prop::collection::vec(1i64..(1 << 20), 2..10),
        ) {
            let mut other = sums.clone();
            for (k, c) in changes.iter().enumerate() {
                let i = (k * 7919) % sums.len();
                other[i] = other[i].wrapping_add(*c);
            }
            let distinct = sums.iter().zip(&other).filter(|(a, b)| a != b).count();
            prop_assume!(distinct >= 2);
            let (a, b) = (digests(&sums), digests(&other));
            prop_assert_eq!(locate(a.0.wrapping_sub(b.0), a.1.wrapping_sub(b.1), sums.len()), None);
        }
    }

    #[test]
    fn equal_replicas_name_nothing() {
        assert_eq!(locate(0, 0, 10), None);
        assert_eq!(locate(0, 12345, 10), None);
    }

    #[test]
    fn deltas_wrap_like_the_digests() {
        assert_eq!(digest_delta(1.0, 3.0), MASK - 1);
        assert_eq!(digest_delta(MASK as f64, 0.0), MASK);
    }
}
