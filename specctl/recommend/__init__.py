"""``specctl recommend``: which draft method fits a target, by the seed's layered flowchart, with evidence.

The modules, in the order a recommendation is made:

    inspection   config.json, safetensors headers (safe_open), GGUF fields: a ModelInfo, no weights loaded
    detect       draft formats: one detect and one check per format (mtp, medusa, eagle3, eagle,
                 draft_model); pure functions of a folder's config and tensor index
    candidates   the drafts found for the target (checked) and the smaller models judged for draft_model
    cost         S(α, ρ, k), ρ and α estimates, workload priors, sparse_attn's roofline
    choices      a Choice (ready configs and commands) and the tree's Nodes
    flowchart    the walk, and ``recommend`` that runs it all into a Recommendation
    probe        --probe: every applicable method through bench's measuring loop, ranked by measured speedup

It reads without loading weights, and downloads nothing unless ``--probe`` needs the target.
What it does not know: how methods work (the runtime does); it only *uses* a method in a probe if
``specctl.config.implemented_methods()`` lists it, and says so when a recommended one is not runnable.
"""

from specctl.recommend.cost import get_workload
from specctl.recommend.flowchart import recommend
from specctl.recommend.probe import apply_probe, probe

__all__ = ["apply_probe", "get_workload", "probe", "recommend"]
