"""A resumable, seeded sampler over a fixed dataset: a new permutation every epoch, and a
state (epoch, position) small enough to store in every checkpoint."""

from __future__ import annotations

import random


class EpochSampler:
    """Yields dataset indices in batches; the order depends only on (seed, epoch)."""

    def __init__(self, num_items: int, seed: int) -> None:
        if num_items < 1:
            raise ValueError("the dataset is empty: nothing to sample")
        self.num_items = num_items
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.num_items))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, size: int) -> list[int]:
        """The next `size` indices, wrapping into the next epoch's permutation when needed."""
        out: list[int] = []
        while len(out) < size:
            if self.position == self.num_items:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            take = min(size - len(out), self.num_items - self.position)
            out.extend(self._order[self.position:self.position + take])
            self.position += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_items": self.num_items}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_items"] != self.num_items or state["seed"] != self.seed:
            raise ValueError(f"sampler state is for {state['num_items']} items / seed {state['seed']}, "
                             f"this dataset has {self.num_items} items / seed {self.seed}")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
