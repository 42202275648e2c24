"""minite: reproducible experiments for native NVFP4 (W4A4) RL — BF16 vs naive TE NVFP4 vs miniTE-aligned.

Layers, from the ground up (each imports only from its own layer or below):
    minite.nvfp4, minite.tokenizer, minite.provenance, ...   the format, quantizers and plumbing
    minite.kernels        Triton W4A4 GEMMs (source in the top-level ``kernels/`` directory, mapped to
                          ``minite.kernels`` by the package install: ``pip install -e .``)
    minite.engines        trainer + sampler per arm
    minite.tasks          verifiable tasks: problems, prompts, rewards
    minite.rl, minite.diagnostics, minite.align
    minite.jobs, minite.report   what ``python -m minite <job>`` and the pipeline run
"""

__version__ = "0.1.0"
