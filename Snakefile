# minite pipeline: BF16 vs naive TE NVFP4 vs miniTE NVFP4 (docs/PIPELINE.md).
#   snakemake --cores all throughput_table                        # cpu profile (embedded tiny model)
#   snakemake --profile workflow/profiles/h200 throughput_table   # one H200
#   snakemake --cores all stability --config arms=[minite_nvfp4]  # one arm (the target before --config)
#   snakemake --profile workflow/profiles/drift drift_study       # the drift study (two H200s)
# Rules live in workflow/rules/; the config of each profile in workflow/profiles/<profile>/pipeline.yaml,
# validated by workflow/schemas/config.schema.yaml.
from snakemake.utils import min_version

min_version("9.0")

# Every path below is relative to the repository, whatever directory snakemake was started from.
workdir: workflow.basedir

report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/targets.smk"
include: "workflow/rules/learner.smk"
include: "workflow/rules/rl.smk"
include: "workflow/rules/drift.smk"
include: "workflow/rules/diagnostics.smk"
include: "workflow/rules/kernels.smk"
include: "workflow/rules/figures.smk"
include: "workflow/rules/notebooks.smk"
