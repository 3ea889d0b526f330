"""Fitting TeaCache's rescaling polynomial for a checkpoint.

TeaCache estimates how much a step would change the model's output from how much the
first block's modulated input changed. The polynomial maps one relative L1 change to the
other. To fit it: run uncached generations, record for every row and step both relative
changes against the row's previous step, and least-squares fit a degree-4 polynomial.

    omnidit fit-teacache MODEL_DIR [--steps 20] [--prompt P ...] [--write]

``--write`` stores it in the checkpoint's model_index.json (``_omnidit_teacache``), where the
engine reads it in preference to the family's published coefficients.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..families.base import Family
from ..request import Request
from .base import StepCache
from .rows import rel_l1, row_slices, run_blocks

KEY = "_omnidit_teacache"


class Recorder(StepCache):
    """A pass-through "step cache" that runs every block and records (input change, output change)."""

    key = "teacache-fit"

    def __init__(self):
        super().__init__()
        self.pairs: list[tuple[float, float]] = []

    def forward(self, family: Family, inputs: dict, requests: list[Request]) -> torch.Tensor:
        x = family.block_inputs(inputs)
        signal = family.cache_signal(x)
        img, _ = run_blocks(family, x, 0, family.num_blocks)
        out = family.head(x.with_streams(img, None))
        rows, signal_rows = x.rows_of("img"), family.signal_rows(x)
        for req, sl in row_slices(requests):
            state = req.state.setdefault(self.key, {})
            # a request's rows, one per line, whatever the layout (packed: its tokens, rows after rows)
            signal_r = signal_rows.part(signal, sl).reshape(req.rows, -1)
            out_r = rows.part(out, sl).reshape(req.rows, -1)
            if "signal" in state:
                xs = rel_l1(signal_r, state["signal"]).tolist()
                ys = rel_l1(out_r, state["out"]).tolist()
                self.pairs.extend(zip(xs, ys))
            state["signal"], state["out"] = signal_r, out_r
        return out


def fit(engine, prompts: list[str], params, degree: int = 4) -> dict:
    """Fit the polynomial on ``engine`` (uncached) over ``prompts``; returns coefficients and fit quality."""
    recorder = Recorder()
    previous, engine.family.step_cache = engine.family.step_cache, recorder
    try:
        engine.generate(prompts, params)
    finally:
        engine.family.step_cache = previous
    x, y = np.array(recorder.pairs).T
    coefficients = np.polyfit(x, y, degree)
    residual = y - np.polyval(coefficients, x)
    return {"coefficients": [float(c) for c in coefficients], "pairs": len(x),
            "r2": float(1 - residual.var() / y.var()), "x_range": [float(x.min()), float(x.max())]}


def write(model_dir: str | Path, result: dict, prompts: list[str], steps: int) -> Path:
    index_path = Path(model_dir) / "model_index.json"
    index = json.loads(index_path.read_text())
    index[KEY] = {"coefficients": result["coefficients"],
                  "fitted_on": {"prompts": len(prompts), "steps": steps, "pairs": result["pairs"],
                                "r2": round(result["r2"], 4)}}
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    return index_path
