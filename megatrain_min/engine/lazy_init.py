"""lazy_init.py -- a model's initial weights made a unit at a time, as an engine reads them.

What it is
    LazyInit(cfg, seed) is the Mapping model.init_weights(cfg, seed) returns -- the same tensors, in
    the same RNG order -- without the dict: a unit's tensors are made when one of its keys is first
    read, and only that unit is held. The engine reads the keys unit by unit, so a model is
    initialised straight into the host store: no second fp32 copy of a 70B model (280 GB) beside it.
Try it
    python -m pytest tests/core/test_model.py -k lazy
"""
from collections.abc import Mapping

import torch

import model


class LazyInit(Mapping):
    def __init__(self, cfg, seed=0):
        self.cfg, self.seed, self.layouts = model.as_config(cfg), seed, model.units(cfg)
        self.unit_of = {e.key: u for u, lay in enumerate(self.layouts) for e in lay.entries}
        self.u, self.cur, self.gen = len(self.layouts), {}, None

    def __contains__(self, key):  # Mapping's default would make the unit's tensors
        return key in self.unit_of

    def __getitem__(self, key):
        u = self.unit_of[key]
        if u < self.u:   # going back: restart the generator (a sequential reader never does)
            self.u, self.gen = -1, torch.Generator().manual_seed(self.seed)
        while self.u < u:  # the units in between are made (and dropped): init_weights' RNG order
            self.u += 1
            self.cur = model.init_unit(self.cfg, self.layouts[self.u], self.gen)
        return self.cur[key]

    def __iter__(self):
        return iter(self.unit_of)

    def __len__(self):
        return len(self.unit_of)
