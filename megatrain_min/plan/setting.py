"""setting.py -- the run being planned, in the numbers every part of the plan reads.

What it is
    Setting: what the caller fixed (the config, the hardware profile, the batch, the modes and
    dtypes, the ranks), checked, and what follows from it alone: the units and their sizes, bytes
    per element of the compute dtype and of the residual, what crosses H2D, the size of a weight
    slot, the tokens of the step and of one rank, one (B, T, d) residual tensor. memory.py and
    timing.py read it; plan() (megatrain_min/plan/__init__.py) makes it.
What it is not
    No decisions: where the boundary activations live, the tile, the resident units and the slabs
    are the plan's steps (memory.py, timing.py).
"""
import dataclasses

import model
from megatrain_min.engine import checks
from megatrain_min.cli import DTYPES, RULES


@dataclasses.dataclass
class Setting:
    cfg: model.GPTConfig
    hw: dict                   # a profile of hardware.HARDWARE, resolved
    batch_size: int            # the global batch: sequences per step, over every rank
    seq_len: int
    micro_batches: int         # per rank
    mode: str                  # "fast" (a bf16 shadow streams) or "lean" (the fp32 master streams)
    dtype: str                 # the compute dtype: "bf16" or "fp32"
    residual_dtype: str
    grad_clip: float   # > 0: the updates wait for the global norm (stream.Trainer.defer_updates)
    skip_nonfinite: bool       # train.py's guard
    chunk_tokens: int | None   # the loss chunk (None: model.default_chunk_tokens)
    host_speed: float          # the host issues ops this many times faster than HOST_OP_S says
    gpus: int = 1              # per node
    nodes: int = 1
    optimizer: str = "adamw"   # the update rule, a name of cli.RULES

    def __post_init__(self):
        """Check the arguments (ValueError, one line), then derive what every step reads."""
        if self.mode not in ("fast", "lean") or self.dtype not in DTYPES or \
                self.residual_dtype not in DTYPES:
            raise ValueError("mode must be fast or lean, dtype and residual dtype bf16 or fp32; "
                             f"got {self.mode!r}, {self.dtype!r} and {self.residual_dtype!r}")
        if self.residual_dtype == "bf16" and self.dtype == "fp32":
            raise ValueError("a bf16 residual needs bf16 compute (--dtype bf16); with fp32 compute "
                             "drop --residual-dtype")
        if self.optimizer not in RULES:
            raise ValueError(f"optimizer must be one of {', '.join(RULES)}; got {self.optimizer!r}")
        if self.seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {self.seq_len}")
        if not all(checks.integer(n) and n >= 1 for n in (self.gpus, self.nodes)):
            raise ValueError("--gpus and --nodes must be integers >= 1, got "
                             f"{self.gpus!r} and {self.nodes!r}")
        checks.check_split(self.batch_size, self.micro_batches, self.gpus * self.nodes,
                           names=("batch size", "micro_batches"))
        cfg = self.cfg
        self.world = self.gpus * self.nodes
        self.cuda = self.hw["gpu_mem_gb"] > 0
        self.units = model.units(cfg)
        layers = [u for u in self.units if u.name.startswith("layer.")]   # model.Layout each
        self.lay, self.head, self.L = layers[0], self.units[-1], len(layers)
        self.params, self.tied = sum(u.numel for u in self.units), cfg.tie_embeddings
        # the embedding's unit (tied: the head)
        self.embed = len(self.units) - 1 if self.tied else 0
        # the units in the order the forward needs them (stream.Trainer.order)
        self.order = [self.embed] + [u for u in range(len(self.units)) if u != self.embed]
        self.defer = self.grad_clip > 0                    # stream.Trainer.defer_updates
        self.rule = RULES[self.optimizer]                  # its state: fp32, 4 B/param per name
        self.states = len(self.rule.state)
        self.cb = DTYPES[self.dtype].itemsize              # bytes: compute
        self.rb = DTYPES[self.residual_dtype].itemsize     # bytes: residual
        self.shadow = self.mode == "fast" and self.dtype == "bf16"   # fast streams a bf16 shadow
        self.sb = 2 if self.shadow else 4                  # bytes per parameter that cross H2D
        # a weight/grad slot holds the largest streamed unit; the all_gather fills N whole shards
        self.n_slot = self.world * self.shard(max(self.lay.numel, self.head.numel))
        self.tokens_step = self.batch_size * self.seq_len  # the global batch
        self.tokens = self.tokens_step // self.world       # what one rank (GPU) computes
        self.act = self.tokens * cfg.d_model * self.rb   # one (B, T, d) residual, all micro-batches
        self.row_b = 2 if (self.shadow and self.rb == 2) else 4   # embedding rows: shadow or master
        self.act_step = self.tokens_step * cfg.d_model * self.rb  # (B, T, d) of the whole step
        self.chunk = self.chunk_tokens or model.default_chunk_tokens(cfg)

    def shard(self, n):
        """One rank's share of n elements (sharded.py: equal shards, the last padded)."""
        return -(-n // self.world)
