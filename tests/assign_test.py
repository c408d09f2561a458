"""The assignment algorithm of every plan (``dmuon_jax._assign``).

The drop-in plan is its call without inputs; dedicated mode gives it the
work of the gather groups placed before (``loads``) and a byte budget per
slot, then permutes owners inside gather groups (``balance``). No devices.
"""

import numpy as np
from absl.testing import absltest, parameterized

import dmuon_jax
from dmuon_jax import _assign, _gather_plan
from dmuon_jax._plan import MatrixUnit, OwnerGroup
from tests import support


def random_units(seed, count=48, layers=6):
  """Units whose cost and bytes are drawn independently."""
  rng = np.random.default_rng(seed)
  return [
    MatrixUnit(
      leaf_index=i,
      path=f'layers_{i % layers}/w{i}',
      batch_index=(),
      shape=(8, 8),
      layer=f'layers_{i % layers}',
      cost=float(rng.uniform(1, 100)),
      nbytes=int(rng.integers(1, 50)),
    )
    for i in range(count)
  ]


def held_bytes(units, owners, n):
  held = np.zeros(n)
  for u, slot in zip(units, owners):
    held[slot] += u.nbytes
  return held


class AssignTest(parameterized.TestCase):
  def test_no_inputs_is_the_drop_in_plan(self):
    # plan_ownership (whole matrices) is assign() alone; zero loads and an
    # unbounded budget change nothing.
    params = support.llama3_matrices(6, 256, 896, 64)
    plan = dmuon_jax.plan_ownership(params, {'data': 8}, owner_groups=None)
    self.assertEqual(tuple(_assign.assign(plan.units, 8)), plan.owners)
    unbounded = _assign.Budget([0] * len(plan.units), [np.inf])
    got = _assign.assign(plan.units, 8, loads=np.zeros(8), budget=unbounded)
    self.assertEqual(tuple(got), plan.owners)

  @parameterized.parameters(0, 1, 2)
  def test_loads_carry_over_within_grahams_bound(self, seed):
    units = random_units(seed)
    n = 8
    before = np.random.default_rng(seed + 10).uniform(0, 300, n)
    loads = before.copy()
    owners = _assign.assign(units, n, loads=loads)
    want = before.copy()
    for u, slot in zip(units, owners):
      want[slot] += u.cost
    np.testing.assert_allclose(loads, want)  # updated in place
    total = before.sum() + sum(u.cost for u in units)
    largest = max(u.cost for u in units)
    self.assertLessEqual(
      loads.max(), max(before.max(), total / n + largest) + 1e-9
    )

  @parameterized.parameters(0, 1, 2)
  def test_budget_bounds_the_bytes(self, seed):
    # Bytes drawn apart from the cost: LPT alone leaves them uneven; with
    # the budget (the mean and 2%) no slot passes the cap, or the mean
    # plus one unit where nothing fits.
    units = random_units(seed)
    n = 8
    mean = sum(u.nbytes for u in units) / n
    cap = 1.02 * mean
    free = held_bytes(units, _assign.assign(units, n), n)
    self.assertGreater(free.max(), 1.1 * mean)
    budget = _assign.Budget([0] * len(units), [cap])
    held = held_bytes(units, _assign.assign(units, n, budget=budget), n)
    largest = max(u.nbytes for u in units)
    self.assertLessEqual(held.max(), max(cap, mean + largest))
    self.assertLess(held.max(), free.max())


class WindowsTest(absltest.TestCase):
  def test_windows_split_only_under_a_budget(self):
    # One group: two slices and its iteration in two restart windows (3
    # and 5). Without a budget (drop-in) a member's slices follow its
    # work, so the windows stay on one member; with one (a gather's bytes
    # even: a slice each) each window goes to its own member.
    units = [
      MatrixUnit(0, 'w', (i,), (4, 8), 'w', 1.0, 10, group=0) for i in range(2)
    ]
    group = OwnerGroup(0, (), (8, 8), (0, 1), (0, 0), (3.0, 5.0))
    args = ([(10.0, 0, -1)], [group], units, [[0, 1]])
    owners, (group,) = _assign.place(*args)
    self.assertEqual(len(set(group.iteration_owners)), 1)
    budget = _assign.Budget([0, 0], [10.2])
    owners, (group,) = _assign.place(*args, budget=budget)
    self.assertEqual(sorted(owners), [0, 1])  # a slice each
    self.assertEqual(sorted(group.iteration_owners), [0, 1])


def apply(per_group, moves):
  """``per_group`` after ``balance``'s moves (what ``slot`` held goes to
  ``move[slot]``)."""
  per_group = [w.copy() for w in per_group]
  for g, move in moves:
    old = per_group[g].copy()
    for s, t in move.items():
      per_group[g][t] = old[s]
  return per_group


class BalanceTest(parameterized.TestCase):
  def test_a_row_exchange_where_no_swap_helps(self):
    # Two rows of two; both groups put their work on row 0. A swap inside
    # a row moves nothing (equal work), a swap across rows would split an
    # owner group's row; exchanging the rows of one group evens it out.
    rows = [[0, 1], [2, 3]]
    per_group = [np.array([1.0, 1.0, 0.0, 0.0]) for _ in range(2)]
    moves = _gather_plan.balance(
      [w.copy() for w in per_group], [True, True], [True, True], rows
    )
    self.assertNotEmpty(moves)
    for _, move in moves:
      self.assertCountEqual(move, [0, 1, 2, 3])
      self.assertEqual({move[0] // 2, move[1] // 2}, {1})  # row to row
    after = apply(per_group, moves)
    self.assertEqual(sum(after).max(), 1.0)

  @parameterized.parameters(0, 1, 2, 3)
  def test_moves_permute_and_never_raise_the_busiest(self, seed):
    rng = np.random.default_rng(seed)
    rows = [list(range(r, r + 4)) for r in range(0, 16, 4)]
    per_group = [rng.uniform(0, 10, 16) for _ in range(4)]
    movable = [True, True, True, False]
    within_row = [False, True, True, False]
    moves = _gather_plan.balance(
      [w.copy() for w in per_group], movable, within_row, rows
    )
    after = apply(per_group, moves)
    for g, move in moves:
      self.assertTrue(movable[g])
      self.assertCountEqual(move, move.values())  # a permutation
      if within_row[g]:  # a row's slots stay together
        dest = {
          r: {move[s] // 4 for s in rows[r] if s in move} for r in range(4)
        }
        self.assertTrue(all(len(d) <= 1 for d in dest.values()), move)
    for before, got in zip(per_group, after):
      np.testing.assert_allclose(np.sort(before), np.sort(got))
    np.testing.assert_array_equal(after[3], per_group[3])
    self.assertLess(sum(after).max(), sum(per_group).max())


if __name__ == '__main__':
  absltest.main()
