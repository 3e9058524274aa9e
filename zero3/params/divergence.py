"""Divergence detection: every rank must issue the same gathers, in the same order.

Collectives only work when every rank issues the same ones in the same order. A model
whose control flow differs between ranks (an MoE block routing each rank to different
experts, a module skipped on one rank) breaks that: ranks gather different parameters in
the same collective. With equal sizes that silently mixes up values; with different
sizes gloo aborts a process that receives more than it expected, and the others lose
their connection, so no rank can say what happened.

The guard has two parts.

*Headers.* Every coalesced all-gather of the fetcher carries a header in front of each
rank's payload (`HEADER_BYTES`, int64 words, see `HEADER_FIELDS`): what is gathered and
why (the fetch unit, the first parameter, how many parameters and bytes, the phase), the
gather's sequence number, and a digest of the *trace*: every unit this rank entered
(forward or backward) since initialize. Headers are identical on all ranks exactly when
the ranks gather the same parameters for the same reason after entering the same units,
so a skipped module that owns only resident parameters (and gathers nothing) is caught
at the next gather too.

*Agreed sizes.* For the headers to arrive at all, every rank must send the same number of
bytes, before anyone knows what the others gather. So every rank *predicts* the next
gather from the history of gathers, which every rank has verified to be the same, so the
prediction is the same on every rank: the gather at the same position in the previous
forward-and-backward (while the sequence so far matches it), else the one that followed
the last gather the previous time, else the static order of the units. Each rank sends
its header and a payload of the predicted size: its real data if its gather is the
predicted one, zeros otherwise. Then
- all headers equal the prediction: the payload is the data (one collective, as always
  in steady state);
- all headers are equal to each other but not to the prediction (the control flow
  changed the same way on every rank): the real payload follows in a second collective;
- headers differ: every rank raises `DivergenceError`. Before raising, the ranks exchange
  their recent traces (one small object all-gather, safe because every rank completed the
  same collective) so that the message names the module each rank entered and the block
  to declare a leaf.

Cost: `HEADER_BYTES` more per all-gather, a few integer operations per unit call, and one
more collective per mispredicted gather (when the control flow changes between steps).
On CUDA a correctly predicted gather's headers are compared at the end of each root
forward and each backward (one host sync there), not after every gather, so that gathers
stay asynchronous; values mixed up in between are never stepped on, because the check
runs before the optimizer can use them. There a diverging rank raises as soon as it sees
its misprediction, and ranks that predicted right may wait for the process-group
timeout. Ranks that issue different *kinds* of collectives (an all-gather against a
reduce-scatter) also wait until the process-group timeout, the last resort.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Callable, Sequence

import torch
from torch import nn

HEADER_FIELDS = ("magic", "sequence", "phase", "unit", "first_param", "count", "nbytes", "trace")
HEADER_WORDS = len(HEADER_FIELDS)
HEADER_BYTES = HEADER_WORDS * 8  # a multiple of 16: the payload after it stays aligned
MAGIC = 0x7A65726F33_0001  # "zero3", header format 1
_MASK = (1 << 63) - 1
TRACE_LENGTH = 64


class DivergenceError(RuntimeError):
    """Ranks issued different collectives: their control flow differs."""


class Phase(enum.IntEnum):
    """Why a gather was issued."""

    FORWARD = 1  # a unit's pre-forward
    BACKWARD = 2  # a unit's pre-backward
    ACCESS = 3  # access discovery: a parameter read while another unit runs
    SAFETY_NET = 4  # backward unpacked a saved parameter that was released
    CHECK = 5  # a header-only check (a step whose forward gathered nothing)
    OTHER = 6  # GatheredParameters, destroy, ...
    PREFETCH = 7  # gathered ahead of use, from the last step's order (schedule.py)


@dataclasses.dataclass(frozen=True)
class Site:
    """What one rank gathers in one collective (hashable: the predictor's key)."""

    phase: Phase
    unit: int  # index of the fetch unit, -1 for none
    first_param: int  # index of the first parameter gathered, -1 for none
    count: int
    nbytes: int  # bytes of this rank's payload (its shards)

    def words(self) -> list[int]:
        return [int(self.phase), self.unit, self.first_param, self.count, self.nbytes]


class Names:
    """Turns the indices in headers and traces back into module and parameter names.

    Every rank builds the same units and the same parameter table, so an index means
    the same thing on every rank.
    """

    def __init__(self, root: nn.Module, unit_names: Sequence[str], param_names: Sequence[str]) -> None:
        self.root = root
        self.unit_names = list(unit_names)
        self.param_names = list(param_names)

    def unit(self, index: int) -> str:
        return self.unit_names[index] if 0 <= index < len(self.unit_names) else "<no unit>"

    def param(self, index: int) -> str:
        return self.param_names[index] if 0 <= index < len(self.param_names) else "<none>"

    def describe(self, header: list[int]) -> str:
        fields = dict(zip(HEADER_FIELDS, header))
        if fields["magic"] != MAGIC:
            return "a collective that is not a zero3 gather (a different operation or payload)"
        try:
            phase = Phase(fields["phase"]).name.lower()
        except ValueError:
            phase = f"phase {fields['phase']}"
        what = f"unit '{self.unit(fields['unit'])}' ({phase})"
        if fields["count"]:
            what += (f", {fields['count']} parameter(s) from '{self.param(fields['first_param'])}', "
                     f"{fields['nbytes']} bytes")
        return f"gather #{fields['sequence']}: {what}"


class GatherGuard:
    """Builds the header of each gather, predicts the next one and checks all ranks' headers.

    Owns: the sequence number, the trace digest, a short log of recent trace events (unit
    indices with their phase), and the predictor's history (the sites of this and the
    previous forward-and-backward, and each site's last successor). Holds no tensors but,
    on CUDA, the received headers not yet checked (world_size x HEADER_WORDS each).
    """

    def __init__(self, names: Names, exchange: Callable[[object], list[object]], rank: int,
                 world_size: int) -> None:
        self.names = names
        self.exchange = exchange  # all-gather of a small object, used only on a mismatch
        self.rank = rank
        self.world_size = world_size
        self.sequence = 0
        self.trace = 0
        self._trace_sent = 0
        self.recent: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=TRACE_LENGTH)
        self.mispredicted = 0
        self._deferred: list[tuple[torch.Tensor, list[int]]] = []
        self._previous: list[Site] = []
        self._current: list[Site] = []
        self._successor: dict[Site | None, Site] = {}

    # ---------------------------------------------------------------- trace
    def enter(self, phase: Phase, unit: int) -> None:
        """Record that this rank entered a unit (hot path: a few integer operations)."""
        self.trace = (self.trace * 1_000_003 + unit * 8 + int(phase)) & _MASK
        self.recent.append((self.sequence, int(phase), unit))

    def trace_unsent(self) -> bool:
        """True if units were entered since the last header went out."""
        return self.trace != self._trace_sent

    # ------------------------------------------------------------ prediction
    def seed(self, sites: Sequence[Site]) -> None:
        """The static guess for a first step: these sites in this order."""
        previous: Site | None = None
        for site in sites:
            self._successor.setdefault(previous, site)
            previous = site

    def start_forward(self) -> None:
        """A root forward begins (on every rank at the same point of the sequence)."""
        if self._current:
            self._previous, self._current = self._current, []

    def predict(self) -> Site | None:
        """The next gather, the same on every rank (their histories have been verified)."""
        i = len(self._current)
        if i < len(self._previous) and (i == 0 or self._previous[i - 1] == self._current[i - 1]):
            return self._previous[i]
        return self._successor.get(self._current[-1] if self._current else None)

    def observe(self, site: Site) -> None:
        self._successor[self._current[-1] if self._current else None] = site
        self._current.append(site)

    # --------------------------------------------------------------- header
    def header(self, site: Site) -> list[int]:
        """The header words of the next gather (and count it)."""
        words = [MAGIC, self.sequence, *site.words(), self.trace]
        self.sequence += 1
        self._trace_sent = self.trace
        return words

    def check(self, received: torch.Tensor, own: list[int], now: bool) -> None:
        """Compare the headers of all ranks (`received`: world_size x HEADER_WORDS int64).

        On CPU, or with `now`, at once; otherwise deferred to `flush()` so that no
        gather waits for the host.
        """
        if now or received.device.type == "cpu":
            self._compare(received.tolist(), own)
        else:
            self._deferred.append((received, own))

    def flush(self) -> None:
        """Compare the deferred headers (one host sync); raise on the first mismatch."""
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, []
        stacked = torch.stack([received for received, _ in deferred]).cpu().tolist()
        for rows, (_, own) in zip(stacked, deferred):
            self._compare(rows, own)

    def _compare(self, rows: list[list[int]], own: list[int]) -> None:
        if all(row == own for row in rows):
            return
        self._deferred.clear()
        raise DivergenceError(self._message(rows))

    # --------------------------------------------------------------- message
    def _message(self, rows: list[list[int]]) -> str:
        lines = [f"  rank {r}: {self.names.describe(row)}" for r, row in enumerate(rows)]
        trace = HEADER_FIELDS.index("trace")
        if len({tuple(row[:trace]) for row in rows}) == 1:
            lines.append("  (the same gather, but the units the ranks entered before it differ)")
        differing_units: list[str] = []
        trace_note = ""
        if all(row[0] == MAGIC for row in rows):
            # Every rank completed this same collective (sizes are agreed in advance) and
            # sees these same headers, so every rank is here: one more collective is safe.
            traces = self.exchange(list(self.recent))
            trace_note, differing_units = self._first_trace_difference(traces)
        if not differing_units:
            differing_units = sorted({self.names.unit(row[3]) for row in rows if row[0] == MAGIC})
        block = self._enclosing_block(differing_units)
        hint = (
            f"Declare the block that holds the rank-dependent branch one fetch unit, gathered whole "
            f"on every rank: zero3.set_z3_leaf_modules(model, [{block[1]}]) before zero3.initialize "
            f"(here '{block[0]}'), or the config's zero_optimization.leaf_module "
            f"{{\"names\": [\"{block[0]}\"]}} / stage3_module_granularity_threshold"
            if block is not None
            else "Make every rank call the same modules in the same order (for example, run each "
                 "module on an empty batch instead of skipping it), or declare the block that holds "
                 "the rank-dependent branch a leaf with zero3.set_z3_leaf_modules(model, [BlockClass])"
        )
        return (
            "zero3: the ranks diverged: they issued different parameter gathers in the same "
            "collective, so the model's control flow differs between ranks (a module called on "
            "some ranks and not on others, or called in a different order).\n"
            + "\n".join(lines)
            + (f"\n{trace_note}" if trace_note else "")
            + f"\n{hint}."
        )

    def _first_trace_difference(self, traces: list[object]) -> tuple[str, list[str]]:
        """The first unit entered differently since the last gather that matched.

        Every earlier gather matched (or this check would have raised there), so gather
        sequence numbers agree between ranks; the events recorded with the current
        sequence number are the units each rank entered since that last match.
        """
        current = self.sequence - 1
        windows = [[(p, u) for s, p, u in events if s == current] for events in traces]
        longest = max(len(w) for w in windows)
        for i in range(longest):
            column = [w[i] if i < len(w) else None for w in windows]
            if len(set(column)) == 1:
                continue
            parts = [
                f"rank {r} entered '{self.names.unit(e[1])}' ({Phase(e[0]).name.lower()})" if e else
                f"rank {r} entered no further unit"
                for r, e in enumerate(column)
            ]
            units = sorted({self.names.unit(e[1]) for e in column if e is not None})
            return f"  first difference since the last matching gather: {'; '.join(parts)}", units
        return "", []

    def _enclosing_block(self, unit_names: list[str]) -> tuple[str, str] | None:
        """(name, class) of the innermost non-container module holding the diverging units.

        For several units, their deepest common ancestor; for one, its parent (the branch
        that calls or skips it is there). Containers (ModuleList, ...) are skipped, as
        DeepSpeed never makes them leaves. None when that is the root itself.
        """
        paths = sorted({tuple(n.split(".")) for n in unit_names if n not in ("<root>", "<no unit>")})
        if not paths:
            return None
        common: list[str] = []
        for parts in zip(*paths):
            if len(set(parts)) != 1:
                break
            common.append(parts[0])
        if len(paths) == 1:
            common = list(paths[0][:-1])
        while common:
            name = ".".join(common)
            try:
                module = self.names.root.get_submodule(name)
            except AttributeError:
                return None
            if type(module).__name__ not in _CONTAINERS:
                return name, type(module).__name__
            common.pop()
        return None


_CONTAINERS = frozenset(torch.nn.modules.container.__all__)
