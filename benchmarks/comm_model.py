"""A communication and time model of one denoising step under dit_core.parallel.

Given a transformer's shape (blocks, hidden size, heads), a step's workload (rows, image and text
tokens, the bytes of its inputs and outputs), a plan (row groups x ring x ulysses) and a machine
(compute rate, link bandwidth and latency), it predicts the bytes every kind of communication
moves per step -- the quantity ``dit_core.parallel.comm`` counts, summed over ranks -- and the
step time. It mirrors the implementation's data movement:

* plan: rank 0 sends each worker its row group's transformer inputs (per-row ones sliced,
  shared ones whole); text is replicated, so every rank of a row group gets the same inputs.
* ulysses, per attention layer and row group of b rows: q/k/v image chunks go out as head
  slices (3 tensors), the output comes back (1), the text output's head slices are all-gathered:
  (U-1) * b * D_head * E * (4 * (H/U) * N + R * T * H).
* ring, per attention layer and row group: every K/V ring shard (2 tensors of H/U heads) visits
  the R-1 other ranks of its ring, in each of the U lanes: (R-1) * 2 * b * N * H * D_head * E.
* gather: non-leader sequence ranks send their output chunk to the leader, row-group leaders
  send their rows' output to rank 0.

Time: each rank computes the linear layers for its image chunk plus all text tokens (text is
replicated) and attention for its queries against the whole sequence with H/U heads. Ulysses
all-to-alls sit on the critical path; ring passes overlap the attention of the block in hand.
"""

from __future__ import annotations

from dataclasses import dataclass


def balanced(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


@dataclass(frozen=True)
class Shape:
    """A DiT: ``attn_layers`` joint attention layers (one per block), hidden size, heads."""

    name: str
    blocks: int
    hidden: int
    heads: int
    attn_layers: int | None = None
    # linear weights a token passes through per block: q/k/v/out (4 D^2) + a 4x MLP (8 D^2)
    linear_per_token: float | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layers(self) -> int:
        return self.attn_layers or self.blocks

    @property
    def params_per_token(self) -> float:
        return self.linear_per_token or 12 * self.hidden ** 2


@dataclass(frozen=True)
class Workload:
    """One step's forward: ``rows`` batch rows of ``image`` + ``text`` tokens; ``row_input_bytes`` /
    ``shared_input_bytes`` the transformer inputs per row / shared by all rows; ``row_output_bytes``
    the output per row; ``elem`` bytes per activation element."""

    rows: int
    image: int
    text: int
    row_input_bytes: int
    shared_input_bytes: int
    row_output_bytes: int
    elem: int = 4


@dataclass(frozen=True)
class Plan:
    rows: int = 1
    ring: int = 1
    ulysses: int = 1

    @property
    def seq(self) -> int:
        return self.ring * self.ulysses

    @property
    def world(self) -> int:
        return self.rows * self.seq

    def __str__(self) -> str:
        return f"rows{self.rows}xring{self.ring}xulysses{self.ulysses}"


@dataclass(frozen=True)
class Machine:
    name: str
    flops: float  # sustained FLOP/s per device
    bandwidth: float  # bytes/s a device sends to its peers
    latency: float = 5e-6  # seconds per message


def step_bytes(shape: Shape, work: Workload, plan: Plan) -> dict[str, int]:
    """Bytes sent per step by all ranks together, by kind (as dit_core.parallel.comm counts them)."""
    groups = [b for b in balanced(work.rows, plan.rows) if b]
    u, r, h, d, e, n, t = plan.ulysses, plan.ring, shape.heads, shape.head_dim, work.elem, work.image, work.text
    out = {"plan": 0, "ulysses": 0, "ring": 0, "gather": 0}
    for g, b in enumerate(groups):
        inputs = b * work.row_input_bytes + work.shared_input_bytes
        out["plan"] += inputs * (plan.seq - 1 if g == 0 else plan.seq)
        if u > 1:
            out["ulysses"] += shape.layers * (u - 1) * b * d * e * (4 * (h // u) * n + r * t * h)
        if r > 1:
            out["ring"] += shape.layers * (r - 1) * 2 * b * n * h * d * e
        chunk = balanced(n, plan.seq)
        out["gather"] += b * work.row_output_bytes * (n - chunk[0]) // n  # chunks to the leader
        if g:
            out["gather"] += b * work.row_output_bytes  # the leader's rows to rank 0
    return out


def step_time(shape: Shape, work: Workload, plan: Plan, machine: Machine) -> dict[str, float]:
    """Predicted seconds of one step on the busiest rank: compute, exposed communication, total."""
    b = balanced(work.rows, plan.rows)[0]
    n, t, d, h = work.image, work.text, shape.head_dim, shape.heads
    local = balanced(n, plan.seq)[0]
    ring_shard = local * plan.ulysses
    heads = h // plan.ulysses
    linear = 2 * shape.params_per_token * (t + local) * b * shape.blocks
    attn_block = 4 * b * (t + ring_shard) * heads * d  # FLOPs per key, for this rank's queries
    attention = attn_block * (t + n) * shape.layers
    e = work.elem
    a2a = 0.0
    if plan.ulysses > 1:
        sent = (plan.ulysses - 1) * b * d * e * (4 * heads * local + t * heads)
        a2a = shape.layers * (sent / machine.bandwidth + 3 * machine.latency)
    ring_exposed = 0.0
    if plan.ring > 1:  # each pass overlaps the attention over the block in hand
        block_bytes = 2 * b * ring_shard * heads * d * e
        per_pass = block_bytes / machine.bandwidth + machine.latency
        per_block = attn_block * ring_shard / machine.flops
        ring_exposed = shape.layers * (plan.ring - 1) * max(0.0, per_pass - per_block)
    io = (b * work.row_input_bytes + work.shared_input_bytes + b * work.row_output_bytes) / machine.bandwidth
    compute = (linear + attention) / machine.flops
    comm = a2a + ring_exposed + (io if plan.world > 1 else 0.0)
    return {"compute_s": compute, "comm_s": comm, "step_s": compute + comm}


def speedup(shape: Shape, work: Workload, plan: Plan, machine: Machine) -> float:
    one = step_time(shape, work, Plan(), machine)["step_s"]
    return one / step_time(shape, work, plan, machine)["step_s"]


# ---- shapes and machines the docs quote (docs/guide/parallelism.md) ----

QWEN_IMAGE = Shape("Qwen-Image transformer", blocks=60, hidden=3072, heads=24)
H100_CLASS_FLOPS = 0.4 * 989e12  # bf16 dense peak 989 TFLOP/s at 40% sustained
NVLINK = Machine("NVLink (900 GB/s)", H100_CLASS_FLOPS, 900e9, 3e-6)
PCIE4 = Machine("PCIe 4 x16 (32 GB/s)", H100_CLASS_FLOPS, 32e9, 10e-6)


def qwen_image_workload(side: int, text: int = 64, rows: int = 1) -> Workload:
    """Qwen-Image at ``side`` x ``side`` pixels: 16 pixels per packed latent token, 64 latent channels
    in and out per token, 3584-wide text embeddings from the Qwen2.5-VL encoder; bf16."""
    n = (side // 16) ** 2
    return Workload(rows=rows, image=n, text=text, row_input_bytes=(n * 64 + text * 3584 + 1) * 2,
                    shared_input_bytes=0, row_output_bytes=n * 64 * 2, elem=2)


def flux_workload(config: dict, image: int, text: int, rows: int, elem: int = 4) -> Workload:
    """FluxTransformer2DModel inputs as dit_core.families.flux builds them (per row: packed latents,
    timestep, distilled guidance in float32, pooled CLIP vector, T5 tokens; shared: text and image
    position ids)."""
    per_row = (image * config["in_channels"] + 1 + config["pooled_projection_dim"]
               + text * config["joint_attention_dim"]) * elem
    per_row += 4 if config.get("guidance_embeds") else 0
    out_channels = (config.get("out_channels") or config["in_channels"]) * config["patch_size"] ** 2
    return Workload(rows=rows, image=image, text=text, row_input_bytes=per_row,
                    shared_input_bytes=(image + text) * 3 * elem, row_output_bytes=image * out_channels * elem,
                    elem=elem)


def wan_workload(config: dict, latent: tuple[int, int, int], text: int, rows: int, elem: int = 4,
                 timestep_elem: int = 8) -> Workload:
    """WanTransformer3DModel inputs as dit_core.families.wan builds them (per row: the latent video
    [C, F, H, W], its timestep (int64, as Wan's scheduler gives it), the padded text embeddings). Text enters only through cross
    attention, whose keys every rank holds whole: no sequence-parallel traffic, so the workload's
    joint text is 0 (the text still rides in each row's inputs)."""
    f, h, w = latent
    pt, ph, pw = config["patch_size"]
    image = (f // pt) * (h // ph) * (w // pw)
    per_row = config["in_channels"] * f * h * w * elem + timestep_elem + text * config["text_dim"] * elem
    out_channels = config.get("out_channels") or config["in_channels"]
    return Workload(rows=rows, image=image, text=0, row_input_bytes=per_row, shared_input_bytes=0,
                    row_output_bytes=out_channels * f * h * w * elem, elem=elem)


def wan_shape(config: dict) -> Shape:
    """Wan's blocks: self attention (sequence-parallel), cross attention to the text (local), FFN."""
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    return Shape("Wan", blocks=config["num_layers"], hidden=hidden, heads=config["num_attention_heads"],
                 linear_per_token=6 * hidden ** 2 + 2 * hidden * config["ffn_dim"])


def flux_shape(config: dict) -> Shape:
    blocks = config["num_layers"] + config["num_single_layers"]
    return Shape("FLUX", blocks=blocks, hidden=config["num_attention_heads"] * config["attention_head_dim"],
                 heads=config["num_attention_heads"])
