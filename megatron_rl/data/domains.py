"""Several task sets in one RL run: the joint task (`MultiTask`), the mixture sampler that
draws each step's prompt groups from the domains by weight (`MixtureSampler`), and the
factories `train.py` calls (`make_task`, `make_sampler`), which give back the single-task
`Task` / `EpochSampler` when `domains` is empty.

`MultiTask` has the interface of `Task` that the RL loop uses: `prompts(split)` (every
domain's prompts, concatenated in the order of `domains`, each prompt's `meta["domain"]`
naming its domain), `needs_sandbox`, `stop_token_ids`, `verifier_factory(addresses)` (a
verifier that sends each item to its own domain's verifier) and `reward_scale_of(meta)`.
Agent domains (`task.type=agent`) are listed in `agent_domains`: their prompts are tasks for
an environment, played as multi-turn episodes by the RL step (`rollout.colocated.Generation.generate`), and their
entry of `DomainVerifier.verifiers` is the domain's environment host, not a scorer.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable, Mapping, Sequence, Union

from megatron_rl.data.sampler import EpochSampler
from megatron_rl.data.tasks import Prompt, Task


class DomainVerifier:
    """Scores `(meta, completion)` items with the verifier of each item's `meta["domain"]`,
    the domains concurrently; rewards come back in the order of the items."""

    def __init__(self, verifiers: Mapping[str, Any]) -> None:
        self.verifiers = dict(verifiers)

    @property
    def calls(self) -> int:
        return sum(getattr(v, "calls", 0) for v in self.verifiers.values())

    @property
    def errors(self) -> int:
        return sum(getattr(v, "errors", 0) for v in self.verifiers.values())

    @property
    def client(self) -> Any:
        """What `RewardService.close` closes: every domain's sandbox client (None without any)."""
        clients = [c for c in (getattr(v, "client", None) for v in self.verifiers.values()) if c is not None]
        return _Clients(clients) if clients else None

    def close(self) -> None:
        """Every domain verifier's own resources (a reward function's threads); clients: `client`."""
        for verifier in self.verifiers.values():
            if callable(getattr(verifier, "close", None)):
                verifier.close()

    async def score(self, items: Sequence[tuple[dict[str, Any], str]]) -> list[float]:
        by_domain: dict[str, list[int]] = {}
        for i, (meta, _) in enumerate(items):
            name = meta.get("domain")
            if name not in self.verifiers:
                raise ValueError(f"item {i} has domain {name!r}; this run's domains are {', '.join(self.verifiers)}")
            by_domain.setdefault(name, []).append(i)
        names = list(by_domain)
        scored = await asyncio.gather(*(self.verifiers[n].score([items[i] for i in by_domain[n]]) for n in names))
        out = [0.0] * len(items)
        for name, scores in zip(names, scored):
            for i, score in zip(by_domain[name], scores):
                out[i] = score
        return out


class _Clients:
    def __init__(self, clients: list[Any]) -> None:
        self.clients = clients

    async def close(self) -> None:
        for client in {id(c): c for c in self.clients}.values():
            await client.close()


class MultiTask:
    """The joint task of a multi-domain run: one `Task` per domain (`domains: {name: DomainConfig}`)."""

    def __init__(self, domains: Mapping[str, Any], tokenizer: Any) -> None:
        self.tasks = {name: Task(d.task, tokenizer) for name, d in domains.items()}
        self.weights = {name: float(d.weight) for name, d in domains.items()}

    @property
    def names(self) -> list[str]:
        return list(self.tasks)

    def prompts(self, split: str) -> list[Prompt]:
        return [dataclasses.replace(p, meta={**p.meta, "domain": name})
                for name, task in self.tasks.items() for p in task.prompts(split)]

    @property
    def is_agent(self) -> bool:
        """False: a joint run is not one agent task (its agent domains are `agent_domains`)."""
        return False

    @property
    def agent_domains(self) -> tuple[str, ...]:
        return tuple(name for name, task in self.tasks.items() if task.is_agent)

    @property
    def needs_sandbox(self) -> bool:
        return any(t.needs_sandbox for t in self.tasks.values())

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The union of the domains' stop tokens: one sampling setting serves the whole batch, so
        a domain without a chat template also stops at another domain's end-of-turn token."""
        return tuple(sorted({i for t in self.tasks.values() for i in t.stop_token_ids}))

    def reward_scale_of(self, meta: Mapping[str, Any]) -> float:
        return self.tasks[meta["domain"]].reward_scale_of(meta)

    def verifier_factory(self, sandbox_addresses: list[str]) -> Callable[[], DomainVerifier]:
        factories = {name: t.verifier_factory(sandbox_addresses if t.needs_sandbox else []) for name, t in
                     self.tasks.items()}
        return lambda: DomainVerifier({name: build() for name, build in factories.items()})


class MixtureSampler:
    """Draws prompt groups from several domains by mixture weight; indices point into the
    concatenated prompt list (domain after domain, as `MultiTask.prompts` builds it).

    Each call adds `size * share` to every active domain's quota (share = weight over the sum of
    the weights of the domains not paused) and hands the `size` draws out one at a time to the
    domain furthest behind its quota (largest remainder, as smooth weighted round robin); what
    is left of a quota carries to the next call, so that over many steps every domain gets its
    share to within one draw even when `size` is small; within a domain an `EpochSampler`
    (seeded per domain) gives the order. Deterministic, and resumed exactly from `state_dict()`
    (quotas, pauses, per-domain positions).
    """

    def __init__(self, sizes: Mapping[str, int], weights: Mapping[str, float], seed: int) -> None:
        if set(sizes) != set(weights):
            raise ValueError(f"domains with prompts {sorted(sizes)} differ from domains with weights {sorted(weights)}")
        self.names = list(sizes)
        self.sizes = dict(sizes)
        self.weights = {n: float(weights[n]) for n in self.names}
        self.seed = seed
        starts = [0]
        for n in self.names:
            starts.append(starts[-1] + self.sizes[n])
        self.offsets = dict(zip(self.names, starts))
        self.samplers = {n: EpochSampler(self.sizes[n], seed * 1000 + i) for i, n in enumerate(self.names)}
        self.quotas = {n: 0.0 for n in self.names}
        self.paused: list[str] = []

    @classmethod
    def for_prompts(cls, prompts: Sequence[Prompt], weights: Mapping[str, float], seed: int) -> "MixtureSampler":
        """A sampler over `prompts`, whose `meta["domain"]` must come in contiguous blocks."""
        sizes: dict[str, int] = {}
        for p in prompts:
            name = p.meta["domain"]
            if name in sizes and name != list(sizes)[-1]:
                raise ValueError(f"domain {name!r} prompts are not contiguous")
            sizes[name] = sizes.get(name, 0) + 1
        missing = [n for n in weights if n not in sizes]
        if missing:
            raise ValueError(f"domains {', '.join(missing)} have no training prompts (task.num_train)")
        return cls(sizes, weights, seed)  # offsets follow the prompts' order

    @property
    def active(self) -> list[str]:
        return [n for n in self.names if n not in self.paused]

    def mixture(self) -> dict[str, float]:
        """Each domain's current share of the draws (0 when paused)."""
        total = sum(self.weights[n] for n in self.active)
        return {n: (self.weights[n] / total if n not in self.paused else 0.0) for n in self.names}

    def pause(self, name: str) -> None:
        """Stop drawing `name`; refused for the last active domain (nothing would be left to train on)."""
        if name not in self.names:
            raise ValueError(f"unknown domain {name!r}: this run's domains are {', '.join(self.names)}")
        if name in self.paused:
            return
        if self.active == [name]:
            raise ValueError(f"domain {name!r} is the last active domain; it cannot be paused")
        self.paused.append(name)
        self.quotas = {n: 0.0 for n in self.names}  # the carried fractions belonged to the old shares

    def allocate(self, size: int) -> dict[str, int]:
        """How many of `size` draws each active domain gets this call (updates the carried quotas)."""
        share = self.mixture()
        for n in self.active:
            self.quotas[n] += size * share[n]
        counts = {n: 0 for n in self.active}
        for _ in range(size):  # each draw to the domain furthest behind its quota (smooth weighted round robin)
            pick = max(self.active, key=lambda n: (self.quotas[n] - counts[n], -self.names.index(n)))
            counts[pick] += 1
        for n in self.active:
            self.quotas[n] -= counts[n]
        return counts

    def next_batch(self, size: int) -> list[int]:
        counts = self.allocate(size)
        return [self.offsets[n] + i for n in self.active for i in self.samplers[n].next_batch(counts[n])]

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "sizes": dict(self.sizes), "quotas": dict(self.quotas),
                "paused": list(self.paused), "samplers": {n: s.state_dict() for n, s in self.samplers.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if dict(state["sizes"]) != self.sizes or state["seed"] != self.seed:
            raise ValueError(f"sampler state is for domains {dict(state['sizes'])} / seed {state['seed']}, this run "
                             f"has {self.sizes} / seed {self.seed}")
        self.quotas = {n: float(state["quotas"][n]) for n in self.names}
        self.paused = list(state["paused"])
        for n, s in self.samplers.items():
            s.load_state_dict(state["samplers"][n])


def make_task(cfg: Any, tokenizer: Any) -> Union[Task, MultiTask]:
    """The run's task: `MultiTask` over `cfg.domains` when set, else `Task(cfg.task)`."""
    return MultiTask(cfg.domains, tokenizer) if cfg.domains else Task(cfg.task, tokenizer)


def make_sampler(task: Union[Task, MultiTask], train_prompts: Sequence[Prompt], seed: int
                 ) -> Union[EpochSampler, MixtureSampler]:
    """The resumable sampler over `train_prompts`: by mixture weight for a `MultiTask`."""
    if isinstance(task, MultiTask):
        return MixtureSampler.for_prompts(train_prompts, task.weights, seed)
    return EpochSampler(len(train_prompts), seed)
