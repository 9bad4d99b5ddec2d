"""Row 9 (optional): torchvision's feature-extractor build beside jaxslice's.

torchvision's `create_feature_extractor` never runs what it drops; jaxslice's build that
ends early should compare. Skipped when torch or torchvision is missing (neither is a
dependency, and this script installs nothing).
"""

from __future__ import annotations

import functools
from typing import Any

from _common import Config, Log, row
from _models import abstract_model, fresh
from _timing import Op, paired

import jaxslice as js

LABEL = "9. jaxslice build end='stage2@0' / torchvision extractor build (resnet50)"


def run(cfg: Config, log: Log) -> dict[str, Any]:
    try:
        from torchvision.models import resnet50
        from torchvision.models.feature_extraction import create_feature_extractor
    except Exception as e:  # ImportError, or a broken torch install
        return {"rows": [{"measure": LABEL, "skipped": f"{type(e).__name__}: {e}"}]}
    log("9. torchvision create_feature_extractor")
    tv = resnet50()
    v, x = abstract_model("resnet50")
    subject = Op(lambda m: js.slice(m, v, x, end="stage2@0"), functools.partial(fresh, "resnet50"))
    reference = Op(lambda _: create_feature_extractor(tv, return_nodes=["layer2"]))
    res = paired(subject, reference, cfg.reps)
    return {"rows": [row(LABEL, res, "info", None)]}
