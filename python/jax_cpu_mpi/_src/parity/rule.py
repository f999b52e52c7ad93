"""XLA GPU's send/recv deadlock check, on a list of point-to-point ops and collectives.

This is the rule of ``VerifyNoCollectiveDeadlocks`` in XLA's ``hlo_verifier.cc``, which
the GPU compiler runs on every scheduled module. It visits the instructions of the entry
computation in XLA's instruction order (which is not JAX's program order: see
:mod:`jax_cpu_mpi._src.parity.xla_order`, which gives the events here in that order), descending
into every called computation (loop bodies, conditional branches) **once**, as
straight-line code that shares one state:

* a state machine ``no expectation -> expect recv`` (after a send) or ``expect send``
  (after a recv), with the pending unmatched sends and recvs;
* a send matches a pending recv (and vice versa) when their source-target pairs are
  **identical** (XLA compares the ``_xla_send_recv_source_target_pairs`` strings: same
  pairs in the same order); shapes do not matter;
* every send/recv is first checked on its own: its pairs must contain no cycle (a
  self-pair ``(i, i)`` is a cycle) and no repeated source or target;
* a second send (recv) in a row must not form a cycle or repeat a source/target together
  with any pending send (recv);
* an all-gather, all-to-all, ragged-all-to-all, collective-permute or collective-broadcast
  while a send or recv is pending is an error (XLA's ``IsOtherCollective`` on instructions
  that call no computation: all-reduce and reduce-scatter call their reduction
  computation, so XLA descends into it instead of checking them);
* a program that ends with sends or recvs pending is an error.

The messages are XLA's, followed by an explanation. The pending sets of XLA are hash
sets; here they keep program order, so every process reports the same text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

Pairs = tuple[tuple[int, int], ...]


def format_pairs(pairs: Pairs) -> str:
    """Pairs as XLA prints them: ``{{0,1},{1,2}}``."""
    return "{" + ",".join(f"{{{s},{t}}}" for s, t in pairs) + "}"


@dataclass(frozen=True)
class P2POp:
    """One psend or precv of a lowered program."""

    #: ``"psend"`` or ``"precv"``.
    kind: str
    #: Unique in the module, in the style of XLA instruction names: ``psend``, ``psend.1``.
    name: str
    #: Source-target pairs over the partitions of the program (JAX's full permutation).
    pairs: Pairs
    #: Per-device type of the data sent or received, e.g. ``f32[1,2]``.
    shape: str
    #: The JAX call, e.g. ``psend(axis_name=('x',), perm=[(0, 1)])``.
    source: str
    #: ``file.py:line`` of the call, when the lowering recorded it.
    location: str | None = None

    def hlo(self) -> str:
        """A one-line text in the style of ``HloInstruction::ToString()``."""
        if self.kind == "psend":
            signature = f"token[] psend({self.shape})"
        else:
            signature = f"{self.shape} precv(token[])"
        return f"%{self.name} = {signature}, source_target_pairs={format_pairs(self.pairs)}"

    def describe(self) -> str:
        where = f" at {self.location}" if self.location else ""
        return f"%{self.name} = {self.source}{where}"


@dataclass(frozen=True)
class Collective:
    """A collective other than psend/precv that XLA's check looks at."""

    #: XLA-style name, e.g. ``collective-permute.1``.
    name: str
    #: A one-line text in the style of ``HloInstruction::ToString()``.
    text: str
    location: str | None = None

    def hlo(self) -> str:
        return self.text

    def describe(self) -> str:
        where = f" at {self.location}" if self.location else ""
        return f"%{self.name}{where}"


Event = P2POp | Collective


@dataclass(frozen=True)
class Violation:
    """A program XLA GPU refuses to compile: XLA's message, then ours."""

    xla_message: str
    explanation: str
    ops: tuple[Event, ...] = field(default=())


def find_cycle(pairs: Pairs) -> list[int] | None:
    """A cycle of ``pairs`` (``[0, 1, 0]``), as XLA's ``collective_permute_cycle::HasCycles``.

    XLA maps each source to its target (the last pair of a source wins) and follows every
    chain; revisiting a device is a cycle, so a self-pair ``(i, i)`` is one.
    """
    successor: dict[int, int] = {}
    for source, target in pairs:
        successor[source] = target
    acyclic: set[int] = set()
    for start in sorted(successor):
        path: list[int] = []
        current: int | None = start
        while current is not None and current not in acyclic:
            if current in path:
                return [*path[path.index(current):], current]
            path.append(current)
            current = successor.get(current)
        acyclic.update(path)
    return None


def find_duplicate(pairs: Pairs) -> str | None:
    """``"source 0"`` / ``"target 1"`` if a device is the source (target) of two pairs."""
    for index, role in ((0, "source"), (1, "target")):
        seen: set[int] = set()
        for pair in pairs:
            if pair[index] in seen:
                return f"{role} {pair[index]}"
            seen.add(pair[index])
    return None


def _conflict(pairs: Pairs) -> str | None:
    """Why XLA's ``VerifyNoConflictingSourceTargetPairs`` rejects ``pairs``, or None."""
    cycle = find_cycle(pairs)
    if cycle is not None:
        return "the cycle " + " -> ".join(map(str, cycle))
    duplicate = find_duplicate(pairs)
    if duplicate is not None:
        return f"{duplicate} appearing twice"
    return None


def _listing(ops: Iterable[Event]) -> str:
    return "\n".join(f"  {op.describe()}" for op in ops)


_CYCLE_FIX = (
    "No single psend or precv may contain a cycle on GPU. Split the cycle: send along "
    "the open chain in one psend/precv pair and along the back edge in a second pair "
    "(e.g. perm=[(0, 1), (1, 2)] then perm=[(2, 0)]), with jax.lax.optimization_barrier "
    "putting the second psend after the first precv (JAX's "
    "test_psend_precv_basic_with_no_deadlock_cycle). For a whole ring, "
    "jax.lax.ppermute is simpler. Our CPU transport itself runs a cycle in one op: "
    "CPU-only programs may turn this check off."
)
_MATCH_RULE = (
    "XLA matches a psend to a precv only when their source-target pairs are identical "
    "(same pairs, same order), checking loop bodies and conditional branches once, as "
    "straight-line code: a precv at the end of a loop body matches a psend at the top of "
    "the body or after the loop."
)
_TIMEOUT_NOTE = (
    "Without this check, the unmatched precv would wait on CPU until recv_timeout "
    "(JAX_CPU_MPI_RECV_TIMEOUT) and then fail."
)


class _Checker:
    """The state machine of ``VerifyNoCollectiveDeadlocks``."""

    def __init__(self) -> None:
        self.expect: str | None = None  # None, "recv" (after a send) or "send"
        self.sends: list[P2POp] = []
        self.recvs: list[P2POp] = []

    def visit(self, event: Event) -> Violation | None:
        if isinstance(event, Collective):
            return self._other_collective(event)
        reason = _conflict(event.pairs)
        if reason is not None:
            return self._own_pairs(event, reason)
        mine, theirs = (self.sends, self.recvs) if event.kind == "psend" else (
            self.recvs, self.sends)
        other_kind = "recv" if event.kind == "psend" else "send"
        if self.expect is None:
            mine.append(event)
            self.expect = other_kind
        elif self.expect == other_kind:  # a second send (recv) in a row
            for pending in mine:
                reason = _conflict(event.pairs + pending.pairs)
                if reason is not None:
                    return self._two_in_a_row(event, pending, reason)
            mine.append(event)
        else:
            match = next((op for op in theirs if op.pairs == event.pairs), None)
            if match is not None:
                theirs.remove(match)
                if not theirs:
                    self.expect = None
            else:
                mine.append(event)
        return None

    def finish(self) -> Violation | None:
        if self.expect is None:
            return None
        sends, recvs = list(self.sends), list(self.recvs)
        if sends and not recvs:
            return Violation(
                "Expected recv to match send",
                "these psends are never matched by a precv with the same source-target "
                f"pairs:\n{_listing(sends)}\n{_MATCH_RULE} Add the matching precv (same "
                "perm), or use jax.lax.ppermute.",
                tuple(sends),
            )
        if recvs and not sends:
            return Violation(
                "Expected send to match recv",
                "these precvs are never matched by a psend with the same source-target "
                f"pairs:\n{_listing(recvs)}\n{_MATCH_RULE} Add the matching psend (same "
                f"perm) or remove the precv. {_TIMEOUT_NOTE}",
                tuple(recvs),
            )
        last: list[P2POp] = []
        for send in list(sends):
            recv = next((r for r in recvs if r.pairs == send.pairs), None)
            if recv is not None:
                recvs.remove(recv)
            else:
                last.append(send)
        for recv in list(recvs):
            send = next((s for s in sends if s.pairs == recv.pairs), None)
            if send is not None:
                sends.remove(send)
            else:
                last.append(recv)
        if not last:
            return None
        return Violation(
            "Deadlock detected. Last checked instructions: "
            + "".join(op.hlo() + "," for op in last),
            "these psends/precvs have no partner with identical source-target pairs:\n"
            f"{_listing(last)}\n{_MATCH_RULE} Give each psend and its precv the same perm. "
            f"{_TIMEOUT_NOTE}",
            tuple(last),
        )

    def _own_pairs(self, op: P2POp, reason: str) -> Violation:
        if reason.startswith("the cycle"):
            xla = ("Expected send and recv instructions to have non-cyclical source-target "
                   f"pairs, but found {op.hlo()}")
            fix = _CYCLE_FIX
        else:
            xla = ("Expected send and recv instructions to have unique source and target "
                   f"pairs, but found {op.hlo()}")
            fix = "Each device may be the source of one pair and the target of one pair."
        return Violation(
            xla,
            f"the source-target pairs of this {op.kind} contain {reason}:\n"
            f"{_listing([op])}\n{fix}",
            (op,),
        )

    def _two_in_a_row(self, op: P2POp, pending: P2POp, reason: str) -> Violation:
        other = "recv" if op.kind == "psend" else "send"
        return Violation(
            f"Expected {other}, but found {op.hlo()}",
            f"this {op.kind} follows another {op.kind} that is still unmatched, and their "
            f"source-target pairs together contain {reason}:\n"
            f"{_listing([pending, op])}\nOn GPU the two would deadlock. Put the "
            f"p{other} matching %{pending.name} between them (order it with "
            "jax.lax.optimization_barrier), or give them pairs that form no cycle.",
            (pending, op),
        )

    def _other_collective(self, event: Collective) -> Violation | None:
        if self.expect is None:
            return None
        pending = [*self.sends, *self.recvs]
        if not pending:  # unreachable in practice, as in XLA
            return Violation(f"Expected send or recv, but found {event.hlo()}",
                             "a collective comes where a psend or precv was expected.",
                             (event,))
        return Violation(
            "Expected send and recv instructions to have the same source-target pairs, "
            "but could not match some instructions. Introducing the following instruction "
            f"will cause a deadlock:\n{event.hlo()}",
            f"this collective runs while these psends/precvs are still unmatched:\n"
            f"{_listing(pending)}\n  then {event.describe()}\nOn GPU no collective may run "
            "between a psend and its matching precv. Move the collective before the psend "
            "or after the precv, and fix the order with jax.lax.optimization_barrier (as "
            "in JAX's GPU performance tips, 'Using psend and precv').",
            (*pending, event),
        )


def check(events: Sequence[Event]) -> Violation | None:
    """Run XLA GPU's send/recv deadlock check over ``events`` (in visiting order)."""
    checker = _Checker()
    for event in events:
        violation = checker.visit(event)
        if violation is not None:
            return violation
    return checker.finish()
