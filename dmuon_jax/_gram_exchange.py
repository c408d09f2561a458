"""The owner groups' Gram exchange: who sends which Gram to whom, in rounds.

An owner group's slice owners (its *members*) each form the Gram of their
slices; the sums reach the group's iteration owner, and the factor it
computes goes back to the members. Those messages run point to point
(``ppermute`` over the owner axes), so a group's traffic stays between its
members (a collective over the whole group axis pays every member's block
on every device, groups of 2 of its 8 devices included). A round is one
``ppermute``: every slot sends at most one Gram and receives at most one.
The messages of all groups are packed into rounds by a bipartite edge
colouring (senders on one side, receivers on the other): as many rounds
as the busiest slot has messages to send or to receive (König), which a
placement that keeps a group's slices on few members keeps small.

Grams and factors are symmetric: each travels as its packed triangle
(:func:`triangle_size` elements, about half the square). Pure NumPy: the
planner predicts the bytes from the same schedule the update runs.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import NamedTuple

# A message: (source slot, destination slot, group index).
Message = tuple[int, int, int]


def triangle_size(g: int) -> int:
  """Elements of a packed ``g x g`` symmetric matrix (see
  ``_staged.pack_symmetric``: odd sizes are padded by one)."""
  even = g + g % 2
  return even * (even + 1) // 2


class Schedule(NamedTuple):
  """The rounds of one restart window.

  Attributes:
    reduce: per round, the members' Grams to iteration owners.
    broadcast: per round, the factors back to the members.
  """

  reduce: tuple[tuple[Message, ...], ...]
  broadcast: tuple[tuple[Message, ...], ...]


def members(groups, owners: Sequence[int]) -> list[tuple[int, ...]]:
  """Per group, the slots holding its slices (sorted)."""
  return [tuple(sorted({owners[u] for u in g.units})) for g in groups]


def schedule(groups, owners: Sequence[int], window: int) -> Schedule:
  """The rounds of the groups' exchange in one restart window.

  Args:
    groups: the plan's ``OwnerGroup`` s.
    owners: the owner slot of each unit of the plan.
    window: the restart window (its iteration owners).
  """
  reduce = []
  for j, (g, held) in enumerate(zip(groups, members(groups, owners))):
    owner = g.iteration_owners[window]
    reduce += [(h, owner, j) for h in held if h != owner]
  back = [(o, h, j) for h, o, j in reduce]
  return Schedule(_rounds(reduce), _rounds(back))


def windows(groups) -> int:
  """The groups' restart windows (the same for every group)."""
  return max((len(g.iteration_owners) for g in groups), default=0)


def exchange_bytes(groups, owners: Sequence[int]) -> float:
  """Bytes one device sends (the busiest, ring model: one ``ppermute`` of
  a block per round) in one update: every window's rounds, each a float32
  packed triangle of the largest Gram."""
  if not groups:
    return 0.0
  rounds = 0
  for w in range(windows(groups)):
    sched = schedule(groups, owners, w)
    rounds += len(sched.reduce) + len(sched.broadcast)
  block = max(triangle_size(g.gram_size) for g in groups)
  return float(rounds * block * 4)


def _rounds(edges: Sequence[Message]) -> tuple[tuple[Message, ...], ...]:
  """``edges`` coloured so that no slot sends or receives twice in one
  colour, in as many colours as the largest number of messages one slot
  sends or receives (alternating-path colouring of a bipartite multigraph);
  each colour's messages in input order."""
  if not edges:
    return ()
  sends = collections.Counter(u for u, _, _ in edges)
  gets = collections.Counter(v for _, v, _ in edges)
  colours = max(max(sends.values()), max(gets.values()))
  at_src: dict[int, dict[int, int]] = collections.defaultdict(dict)
  at_dst: dict[int, dict[int, int]] = collections.defaultdict(dict)
  colour = [0] * len(edges)

  def put(e, c):
    colour[e] = c
    at_src[edges[e][0]][c] = e
    at_dst[edges[e][1]][c] = e

  for e, (u, v, _) in enumerate(edges):
    a = next(c for c in range(colours) if c not in at_src[u])
    b = next(c for c in range(colours) if c not in at_dst[v])
    if a in at_dst[v]:
      # Swap a and b on the path from v that alternates a, b, a, ...: it
      # cannot reach u (a is free there), and frees a at v.
      path, node, on_dst, c = [], v, True, a
      while True:
        table = at_dst if on_dst else at_src
        if c not in table[node]:
          break
        f = table[node][c]
        path.append(f)
        node = edges[f][0] if on_dst else edges[f][1]
        on_dst, c = not on_dst, b if c == a else a
      for f in path:
        del at_src[edges[f][0]][colour[f]]
        del at_dst[edges[f][1]][colour[f]]
      for f in path:
        put(f, b if colour[f] == a else a)
    put(e, a)
  return tuple(
    tuple(edges[e] for e in range(len(edges)) if colour[e] == c)
    for c in range(colours)
  )
