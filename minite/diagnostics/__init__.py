"""minite.diagnostics: measure the trainer/sampler gap, show where it comes from, attribute it to causes.

    metrics.py      token- and sequence-level mismatch (k1, k3, chi2, token_mult_prob_error, |dp|, Pearson, ...)
                    with the definitions of verl rollout_corr, NeMo-RL and TRL, in float64
    localise.py     both engines on the same tokens, per layer/op relative error, router top-k disagreement,
                    first divergence beyond rounding (trainer: HF forward hooks; sampler: decode-path capture)
    attribution.py  naive -> aligned one cause at a time: forward, reverse and exact Shapley shares
    figures.py      layer x op heatmap, attribution waterfall (png + pdf)
    run.py          the engine-facing runner the ``diagnose`` job (minite/jobs/diagnose.py) uses
Alignment itself (apply + verify the minite_nvfp4 contract) is ``minite.align``.
"""
