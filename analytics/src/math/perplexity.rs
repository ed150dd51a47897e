//! Perplexity across ranks: exp(Σ_k loss_k·tokens_k / Σ_k tokens_k). Each rank's loss is
//! already a token mean, so weighting by tokens recovers the mean over all tokens; the exp of
//! an unweighted mean of means would be wrong whenever ranks see different token counts.

/// Token-weighted perplexity of `(loss, tokens)` pairs. `None` when there are no tokens; NaN
/// when a rank with tokens has a non-finite loss (a diverged rank must show, not vanish).
pub fn perplexity(pairs: &[(f64, f64)]) -> Option<f64> {
    let mut weighted = 0.0;
    let mut tokens = 0.0;
    for &(loss, n) in pairs {
        if n > 0.0 {
            weighted += loss * n;
            tokens += n;
        }
    }
    (tokens > 0.0).then(|| (weighted / tokens).exp())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_by_tokens() {
        // 1 token at loss 0 and 3 tokens at loss 4: mean loss 3, not 2.
        let p = perplexity(&[(0.0, 1.0), (4.0, 3.0)]).unwrap();
        assert!((p - 3f64.exp()).abs() < 1e-9);
        assert_eq!(perplexity(&[(1.0, 0.0)]), None);
        assert!(perplexity(&[(f64::NAN, 2.0), (1.0, 2.0)]).unwrap().is_nan());
    }
}
