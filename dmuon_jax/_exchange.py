"""Static routes between sharded params and owner buffers (all-to-all).

Used inside the drop-in update's ``shard_map`` (and by the explicit path
for reduced gradients: an exchange whose leaves are all replicated). A
Muon leaf whose sharded dimensions are all matrix dimensions (reduction
or output axes: rows, columns, several axes on one dimension, both
dimensions) is *routed*:

* to the owners: every device sends each owner of its *axis group* (the
  devices that differ from it only on the leaf's sharding axes ``A``) its
  piece of the owner's matrices: one ``all_to_all`` over ``A`` per
  (axis set, dtype). The owner receives each piece exactly once (each device
  of the group holds a different block) and assembles whole matrices.
* back: each owner sends the devices of its axis group their blocks of
  the results (one ``all_to_all`` over ``A``, the forward one reversed),
  then every device gathers the blocks of the owners off its axis group
  (one ``all_gather`` over the other owner axes: HSDP's ``'replicate'``,
  whose devices hold equal shards). Per device that is the bytes of one
  ``all_to_all`` over all N devices (``(N - 1)`` blocks), in two
  collectives over ``|A|`` and ``N / |A|`` devices: XLA:CPU compiles an
  ``all_to_all`` into one kernel per peer, and the owner builds ``|A|``
  blocks, not N.

Both directions move what a device must receive and nothing more (plus the
padding of rows to the largest owner's share). Which units a device packs
and sends, and at which offsets, is read from slot-indexed tables inside
loops with run-time trip counts: one program for every device, whatever
its share. Leaves that are replicated
need no communication to reach their owners; their results come back by one
``all_gather`` of compact per-owner buffers. Leaves sharded along a stack
(batch) axis are gathered whole first (see :attr:`Exchange.gathered`).

Also here, as the second user of the gathers in ``_gather``: the checks of
the reduced (plain-``jit``) route and the explicit ``Dedication`` API
(``block``, ``sequential``, ``scan``: a user function run on each group's
gathered matrices).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dmuon_jax import _checks, _gather, _layout, _mesh, _plan

P = jax.sharding.PartitionSpec


class _Routed:
  """One routed leaf: its axis set and how a matrix splits into pieces."""

  def __init__(self, spec, entries, sizes):
    # The leaf's own local shard shape, and that of the view (a sliced
    # spec's view splits one dimension; see _plan.sliced_spec).
    def local(shape, entries):
      return tuple(
        n // math.prod(sizes[a] for a in e) for n, e in zip(shape, entries)
      )

    self.leaf_local = local(spec.leaf_shape, entries)
    entries = _plan.view_entries(spec, entries)
    if spec.sliced:
      d = spec.slice_axis - 1
      shards = math.prod(sizes[a] for a in entries[d])
      if shards != spec.shape[d]:
        raise ValueError(
          f'dmuon: param {spec.path!r} is sharded {shards} ways along the '
          'dimension its owner group slices, but the optimizer state was '
          f'laid out for {spec.shape[d]}. Make the state again with init() '
          'on params sharded as in training.'
        )
    self.view_local = local(spec.shape, entries)
    canon = spec.reduction_axes + spec.output_axes
    self.dim_axes = tuple(tuple(entries[a]) for a in canon)
    axes = {a for e in self.dim_axes for a in e}
    self.axes = tuple(a for a in sizes if a in axes)  # mesh order
    self.axis_sizes = tuple(sizes[a] for a in self.axes)
    self.full = tuple(spec.shape[a] for a in canon)
    self.piece = local(self.full, self.dim_axes)
    self.piece_size = math.prod(self.piece)
    self.perm = spec.batch_axes + canon
    # assemble's transpose: per matrix dim its axes (member order), then
    # its piece.
    self.order = []
    for j, dim in enumerate(self.dim_axes):
      self.order += [self.axes.index(a) for a in dim] + [len(self.axes) + j]
    self.batch_shape = tuple(spec.shape[a] for a in spec.batch_axes)

  def assemble(self, pieces: jax.Array) -> jax.Array:
    """``(blocks, *piece)`` pieces (member order) -> the whole matrix
    in canonical (reduction, output) dims."""
    x = pieces.reshape(self.axis_sizes + self.piece)
    return jnp.transpose(x, self.order).reshape(self.full)

  def split(self, full: jax.Array) -> jax.Array:
    """Inverse of :meth:`assemble`: ``(blocks, piece_size)``."""
    sizes = self.axis_sizes + self.piece
    x = full.reshape([sizes[k] for k in self.order])
    order = tuple(int(k) for k in np.argsort(self.order))
    blocks = math.prod(self.axis_sizes)
    return jnp.transpose(x, order).reshape(blocks, self.piece_size)


class Exchange:
  """Routes of one owner layout for given param shardings.

  Attributes:
    routed: plan leaf index -> its route, for routed leaves.
    gathered: plan leaf indices gathered whole before Newton–Schulz (a
      sharded stack axis).
    fwd_units: per route class ``(axes, dtype group)`` (its forward
      all-to-all and its way back: the same rows, reversed, then gathered
      over the other owner axes), per slot its routed units.
    routes: per route (a class, a leaf and a unit shape) ``(class, leaf,
      unit shape, table)``, the table of every slot's units: (offset in the
      class's rows, in the buffer).
    rep: per dtype group and unit shape of the non-routed leaves' units,
      ``(group, shape, table)``: (offset in the buffer, in the compact
      one).
  """

  def __init__(self, layout: _layout.Layout, entries: Sequence[_mesh.Entries]):
    """Builds the routes.

    Args:
      layout: the owner layout (one group; owners range over its plan's
        axes).
      entries: each plan leaf's sharding over the owner axes (size-1 and
        tensor-parallel axes removed), per dimension.
    """
    self.layout = lay = layout
    plan = lay.plan
    self.axes = plan.axis_names
    self.sizes = dict(zip(plan.axis_names, plan.mesh_shape))
    self.entries = list(entries)
    self.routed: dict[int, _Routed] = {}
    self.gathered: set[int] = set()
    for i, spec in enumerate(plan.leaves):
      view = _plan.view_entries(spec, entries[i])
      sharded = {d for d, axes in enumerate(view) if axes}
      if sharded <= set(spec.reduction_axes + spec.output_axes):
        if sharded:
          self.routed[i] = _Routed(spec, entries[i], self.sizes)
      else:
        self.gathered.add(i)
    self.whole = [i for i in range(len(plan.leaves)) if i not in self.routed]
    # Forward classes: (axes, dtype group) -> per owner its routed units.
    # Replicated (and gathered) leaves: per dtype group, per owner its
    # units, packed compactly for one all_gather.
    self.fwd_units: dict[tuple, list[list[int]]] = {}
    rep_units = []
    r = lambda u: self.routed.get(lay.unit_leaf[u])
    for g, slots in enumerate(lay.slot_units):
      classes = _group(slots, lambda u: getattr(r(u), 'axes', None))
      rep_units.append(classes.pop(None, [[] for _ in slots]))
      self.fwd_units.update({(axes, g): per for axes, per in classes.items()})
    self.fwd_off: dict[int, int] = {}
    self.fwd_size = {
      key: _offsets(per, lambda u: r(u).piece_size, self.fwd_off)
      for key, per in self.fwd_units.items()
    }
    self.rep_off: dict[int, int] = {}
    self.rep_size = [
      _offsets(per, lay.unit_size.__getitem__, self.rep_off)
      for per in rep_units
    ]
    # Slot tables: what each device packs, sends back and gathers, read
    # by its slot (loops with run-time trip counts, one program for all
    # devices): per route of a class (its units of one route and shape,
    # led by the first one's leaf), and per replicated unit shape.
    shape = lambda u: plan.units[u].shape
    route = lambda u: (
      (r(u).axis_sizes, r(u).piece, r(u).dim_axes, r(u).full),
      shape(u),
    )
    self.routes: list[tuple] = []
    for key, per_slot in self.fwd_units.items():
      for per in _group(per_slot, route).values():
        u = next(us[0] for us in per if us)
        table = _layout.units_table(per, self.fwd_off, lay.unit_offset)
        self.routes.append((key, lay.unit_leaf[u], shape(u), table))
    self.rep: list[tuple] = []
    for g, per_slot in enumerate(rep_units):
      by_shape = _group(per_slot, shape)
      self.rep += [
        (g, s, _layout.units_table(by_shape[s], lay.unit_offset, self.rep_off))
        for s in sorted(by_shape)
      ]

  def size(self, axes) -> int:
    """The devices over mesh axes ``axes``."""
    return math.prod(self.sizes[a] for a in axes)

  # -- forward: pieces to the owners --------------------------------------

  def to_owners(self, targets: Sequence[jax.Array]) -> tuple:
    """This device's owner buffers (one per dtype group, in its leaves'
    promoted dtype) from its shards of the plan leaves ``targets``: each
    routed unit assembled from the pieces its class's all-to-all brings, the
    others read from their whole leaves (all-gathered first where
    sharded)."""
    lay = self.layout
    dtypes = [lay.promoted(targets, g) for g in range(lay.num_groups)]
    recv = {}  # per class, (group size, row): rows in member order
    for key, per_slot in self.fwd_units.items():
      axes, g = key
      others = tuple(a for a in self.axes if a not in axes)
      spread = self.size(others) > 1
      group_size = self.size(axes)
      leaves = {lay.unit_leaf[u]: None for per in per_slot for u in per}
      # Each local piece goes to exactly one owner; this device sends those
      # of the owners at its own coordinates off the class's axes. One
      # scatter per leaf places its pieces (not a slice per unit: the
      # DeepSeek-V3-like stack has 44,834), at rows numbered over every
      # coordinate and shifted by this device's: other coordinates' rows
      # fall outside and are dropped (one program for all devices, no
      # buffer for other rows).
      out = _gather.in_loop(
        jnp.zeros((group_size, self.fwd_size[key]), dtypes[g]),
        [targets[i] for i in leaves],
      )
      shift = np.zeros(2, np.int32)
      if spread:
        shift = jnp.stack(
          [jax.lax.axis_index(others) * group_size, jnp.zeros((), jnp.int32)]
        )
      order = others + tuple(axes)
      for i in leaves:
        r = self.routed[i]
        pieces = jnp.transpose(targets[i].reshape(r.view_local), r.perm)
        # The count is explicit: a -1 cannot be inferred for an empty leaf.
        count = math.prod(r.batch_shape)
        pieces = pieces.reshape(count, r.piece_size).astype(dtypes[g])
        if not pieces.size:
          continue
        # Per piece (at its unit's flat batch index), its owner's row over
        # (others, axes) and its offset in that row.
        units = lay.leaf_units[i]
        owners = np.asarray([lay.plan.owners[u] for u in units])
        rows = _gather.renumber(owners, self.axes, order, self.sizes)
        at = np.zeros((len(units), 2), np.int32)
        at[[lay.unit_batch[u] for u in units]] = np.stack(
          [rows, [self.fwd_off[u] for u in units]], 1
        )
        out = jax.lax.scatter(
          out,
          jnp.asarray(at) - shift,
          pieces,
          jax.lax.ScatterDimensionNumbers(
            update_window_dims=(1,),
            inserted_window_dims=(0,),
            scatter_dims_to_operand_dims=(0, 1),
          ),
          indices_are_sorted=False,
          unique_indices=True,
          mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
        )
      out = _gather.to_varying(out, self.axes) if spread else out
      recv[key] = jax.lax.all_to_all(out, axes, 0, 0, tiled=True)
    full = {}  # to_matrices of each whole leaf
    for i in self.whole:
      x = targets[i]
      for dim, axes in enumerate(self.entries[i]):
        if axes:
          x = jax.lax.all_gather(x, axes, axis=dim, tiled=True, to='invarying')
      full[i] = _layout.to_matrices(x, lay.plan.leaves[i])

    def pack(rows):
      bufs = [jnp.zeros((n,), dt) for n, dt in zip(lay.local_sizes, dtypes)]
      for (key, i, _, _), row in zip(self.routes, rows):
        r, got = self.routed[i], recv[key]
        bufs[key[1]] = _layout.write_at(
          bufs[key[1]],
          row,
          lambda src, r=r, got=got: r.assemble(
            jax.lax.dynamic_slice_in_dim(got, src, r.piece_size, axis=1)
          ),
        )
      whole = rows[len(self.routes) :]
      return tuple(lay.pack_whole_at(bufs, full, self.whole, whole))

    # Every device runs one program: its units and offsets are read from
    # tables by its slot.
    tables = [t for *_, t in self.routes] + lay.whole_tables(self.whole)
    return _gather.with_slot_rows(lay, pack, tables)

  def from_owners(self, ortho: Sequence[jax.Array]) -> list[jax.Array]:
    """This device's shard of each plan leaf from the owners' results
    (``ortho``: this device's owner buffers): the non-routed leaves' by
    one all-gather of compact per-owner buffers; each routed class's rows
    by its forward all-to-all reversed, then an all-gather over the other
    owner axes."""
    lay = self.layout
    out = [None] * len(lay.plan.leaves)
    reps = [g for g in range(lay.num_groups) if self.rep_size[g]]
    if reps:

      def rep_pack(rows, bufs):
        """This owner's results of non-routed leaves, compactly."""
        packed = [jnp.zeros((n,), b.dtype) for n, b in zip(self.rep_size, bufs)]
        for (g, shape, _), row in zip(self.rep, rows):
          packed[g] = _layout.write_at(
            packed[g],
            row,
            lambda s, b=bufs[g], sh=shape: lay.matrix_at(b, s, sh),
          )
        return tuple(packed[g] for g in reps)

      tables = [t for *_, t in self.rep]
      packed = _gather.with_slot_rows(lay, rep_pack, tables, ortho)
      gathered = [None] * lay.num_groups
      for g, c in zip(reps, packed):
        gathered[g] = _gather.gather_from_owners(c, self.axes)
      got = lay.unpack_full(gathered, self.whole, self.rep_size, self.rep_off)
      for i, x in zip(self.whole, got):  # this device's shard of it
        for dim, axes in enumerate(self.entries[i]):
          if axes:
            size = x.shape[dim] // self.size(axes)
            at = jax.lax.axis_index(axes) * size
            x = jax.lax.dynamic_slice_in_dim(x, at, size, axis=dim)
        out[i] = x
    back = {}  # per class, every owner's result rows and their order
    for key in self.fwd_units:
      axes, g = key
      routes = [route for route in self.routes if route[0] == key]

      def send_back(rows, bufs, key=key, g=g, routes=routes):
        """This owner's ``(group size, row)`` result pieces of class
        ``key`` for the devices of its axis group (member order)."""
        rows_shape = (self.size(key[0]), max(self.fwd_size[key], 1))
        x = jnp.zeros(rows_shape, bufs[g].dtype)
        for (_, i, shape, _), row in zip(routes, rows):
          get = lambda s, r=self.routed[i], shape=shape: r.split(
            lay.matrix_at(bufs[g], s, shape).reshape(r.full)
          )
          x = _layout.write_at(x, row, get, back=True)
        return x

      tables = [t for *_, t in routes]
      x = _gather.with_slot_rows(lay, send_back, tables, ortho)
      x = jax.lax.all_to_all(x, axes, 0, 0, tiled=True)
      others = tuple(a for a in self.axes if a not in axes)
      if self.size(others) > 1:
        x = jax.lax.all_gather(x, others, axis=0, tiled=False)
      # x: rows numbered row-major over (others..., axes...).
      back[key] = x.reshape(lay.num_slots, -1), others + tuple(axes)
    for i, r in self.routed.items():  # this device's shard of each
      units = lay.leaf_units[i]
      buf, order = back[(r.axes, lay.unit_group[units[0]])]
      # One gather of the leaf's pieces (each at its owner's row and
      # offset: a table of the leaf's unit count), not a slice per unit
      # (owner groups cut a matrix into many units: Llama-3-8B at N =
      # 1024 has 1,664; compile 54.0 s -> 20.1 s).
      owners = [lay.plan.owners[u] for u in units]
      rows = _gather.renumber(owners, self.axes, order, self.sizes)
      where = np.int32([rows, [self.fwd_off[u] for u in units]]).T
      mats = jax.vmap(
        lambda at, buf=buf, r=r: jax.lax.dynamic_slice(
          buf, at, (1, r.piece_size)
        )[0]
      )(where)
      x = mats.reshape(r.batch_shape + r.piece)
      x = jnp.transpose(x, tuple(np.argsort(r.perm)))
      out[i] = x.reshape(r.leaf_local)
    return out

  # -- the cost model ------------------------------------------------------

  def byte_routes(self, itemsizes: Sequence[int]) -> tuple[list, list]:
    """What one update moves, as :meth:`OwnershipPlan.collective_bytes`
    predicts it from ``routes`` and ``whole``: per class (axes ``A``) its
    ``|A|`` and row bytes (rows padded to the largest owner's share, as in
    the program), the non-routed leaves' compact rows as a class over one
    device (all-gathered), and the leaves gathered whole.

    Args:
      itemsizes: bytes per element of each dtype group's buffers.

    Returns:
      ``(routes, whole)``: ``(group size, bytes)`` pairs.
    """
    lay = self.layout
    routes = [
      (self.size(axes), self.fwd_size[(axes, g)] * itemsizes[g])
      for axes, g in self.fwd_units
    ] + [(1, rows * itemsizes[g]) for g, rows in enumerate(self.rep_size)]
    whole = [
      (
        self.size([a for e in self.entries[i] for a in e]),
        math.prod(lay.plan.leaves[i].shape)
        * itemsizes[lay.unit_group[lay.leaf_units[i][0]]],
      )
      for i in self.gathered
    ]
    return routes, whole


def _group(per_slot, key_of) -> dict:
  """Each slot's units grouped by ``key_of(unit)``: key -> per slot its
  units (keys in the order of their first units)."""
  out = {}
  for s, units in enumerate(per_slot):
    for u in units:
      out.setdefault(key_of(u), [[] for _ in per_slot])[s].append(u)
  return out


def _offsets(per_slot, size_of, offsets: dict[int, int]) -> int:
  """Writes each unit's offset in its slot's row (units back to back) into
  ``offsets``; returns the longest row (0 without slots)."""
  longest = 0
  for units in per_slot:
    ends = np.cumsum([0] + [size_of(u) for u in units]).tolist()
    offsets.update(zip(units, ends))
    longest = max(longest, ends[-1])
  return longest


def reduced_route(ded, who: str) -> bool:
  """Whether the model's gathers can be reduced gathers under plain jit:
  a distributed layout whose owner axes (and tensor-parallel axis, if
  any) are all ``Explicit`` in its mesh (jax refuses ``reduced`` over other
  axes, and types ``unreduced`` cotangents only on meshes whose axes are
  all Explicit).

  Raises (naming ``who``) where the owner axes are Explicit but the
  tensor-parallel axis is not: under plain jit such a model would need
  cotangents typed ``unreduced`` over the owner axes on a mesh with an
  Auto axis, which jax does not type (jax 0.10: an assertion in
  ``getu``)."""
  if not ded.layout.distributed or ded.mesh is None:
    return False
  types = dict(zip(ded.mesh.axis_names, ded.mesh.axis_types))
  explicit = lambda a: types.get(a) == jax.sharding.AxisType.Explicit
  tp = ded.tensor_parallel_axis
  if not all(explicit(a) for a in ded.buffer_axes):
    return False
  if ded.layout.tp_size > 1 and not explicit(tp):
    raise ValueError(
      f'dmuon: {who} ran under plain jax.jit/nnx.jit on a mesh whose owner '
      f'axes {tuple(ded.buffer_axes)} are Explicit and whose '
      f'tensor-parallel axis {tp!r} is not. Its tensor-parallel matrices '
      'are gathered typed reduced over the owner axes, and jax types the '
      'unreduced gradients only on meshes whose axes are all Explicit. '
      f'Make {tp!r} Explicit too (jax.make_mesh(..., axis_types='
      '(jax.sharding.AxisType.Explicit,) * 3); a row-parallel layer then '
      "names its output's sharding, e.g. out_sharding=P(ded.axes, None, "
      'None)), or keep it Auto and decorate the step with '
      '@dmuon_jax.flax.train_step(ded).'
    )
  return True


# -- the explicit Dedication API: a user function run on gathered groups --


def fill(ded, b: int, sub: list[int], sub_rest, mats, layer=False) -> Any:
  """Boundary ``b``'s params subtree from its rest leaves (gathered here;
  ``layer``: one layer's of a stack) and targets."""
  leaves = [None] * len(ded.leaf_paths)
  for i, x in zip(sub, sub_rest):
    leaves[i] = mats.get(i, _gather.gather_leaf(ded, i, x, layer))
  tree = jax.tree.unflatten(ded.treedef, leaves)
  return _checks.subtree(tree, ded.boundary_keys[b])


def all_params(ded, dedicated) -> Any:
  """The whole params tree inside ``shard_map`` (see
  :meth:`dmuon_jax.Dedication.params`)."""
  leaves = ded.treedef.flatten_up_to(_gather.gather_rest(ded, dedicated))
  for g, iters in enumerate(ded.layout.iterations):
    local = list(ded.layout.split_groups(dedicated.owned.buffers)[g])
    gather = lambda local, it=None, g=g: _gather.materialize(
      ded, g, _gather.gather_replicate(ded, local), it
    )
    if iters:  # every scan iteration's, stacked
      got = jax.lax.map(lambda a, f=gather: f(*a), (local, jnp.arange(iters)))
      got = {i: m.reshape((-1,) + m.shape[2:]) for i, m in got.items()}
    else:
      got = gather(local)
    for i, x in got.items():
      leaves[i] = x
  return jax.tree.unflatten(ded.treedef, leaves)


def run_group(ded, g: int, body: Callable[..., Any]) -> Callable[..., Any]:
  """``(dedicated, *args) -> body(block_params_list, *args)``, group ``g``
  gathered (Z2/Z3 as configured); one subtree per boundary of the group.
  A scanned stack's group is called as ``(dedicated, carry)``: a
  ``lax.scan`` over its iterations, ``body`` given one subtree per layer
  of the iteration."""
  bs, iters = ded.groups[g], ded.layout.iterations[g]
  names = [ded.boundaries.names[b] for b in bs]
  # Per boundary, all leaves (targets or not) under its module path.
  subs = [
    [
      i
      for i, p in enumerate(ded.leaf_paths)
      if not n or f'{p}/'.startswith(n + '/')
    ]
    for n in names
  ]

  def run(rep_local, sub_rests, *args):
    iteration = args[-1] if iters else None  # scanned: (carry, iteration)
    mats = _gather.materialize(ded, g, rep_local, iteration)
    if not iters:
      trees = [
        fill(ded, b, sub, sub_rest, mats)
        for b, sub, sub_rest in zip(bs, subs, sub_rests)
      ]
      return body(trees, *args)
    trees = [  # the stack: a subtree per layer of the iteration
      fill(
        ded,
        bs[0],
        subs[0],
        [None if x is None else x[j] for x in sub_rests],
        {i: m[j] for i, m in mats.items()},
        True,
      )
      for j in range(ded.layers_per_gather)
    ]
    return body(trees, *args[:-1])

  # Z3: gathered again in the backward pass.
  inner = run
  if ded.reshard_after_forward:
    inner = _gather.regather_in_backward(run, ded.remat_policy, names)

  def call(dedicated, *args):
    rest = ded.treedef.flatten_up_to(dedicated.rest)
    local = list(ded.layout.split_groups(dedicated.owned.buffers)[g])
    if not iters:
      return inner(
        _gather.gather_replicate(ded, _gather.after_inputs(local, args)),
        [[rest[i] for i in sub] for sub in subs],
        *args,
      )

    def step(carry, xs):
      iteration, owned, sub_rest = xs
      rep = _gather.gather_replicate(ded, owned)
      return inner(rep, sub_rest, carry, iteration), None

    shape = lambda x: (iters, ded.layers_per_gather) + x.shape[1:]
    sub_rest = [
      None if rest[i] is None else rest[i].reshape(shape(rest[i]))
      for i in subs[0]
    ]
    return jax.lax.scan(step, args[0], (jnp.arange(iters), local, sub_rest))[0]

  return call


def boundary_index(ded, boundary: str, scanned: bool) -> int:
  if boundary not in ded.boundaries.names:
    raise ValueError(
      f'dmuon: no hook boundary {boundary!r}; the boundaries are '
      f'{list(ded.boundaries.names)}. Pass one of them (the path of '
      'the block subtree, as dmuon_jax.find_hook_boundaries(params) '
      'shows).'
    )
  b = ded.boundaries.names.index(boundary)
  if ded.boundaries.scanned[b] != scanned:
    raise ValueError(
      f'dmuon: boundary {boundary!r} is '
      f'{"a scanned stack" if not scanned else "not scanned"}; use '
      f'Dedication.{"scan" if not scanned else "block or sequential"}.'
    )
  return b


def block(ded, fn: Callable[..., Any], boundary: str) -> Callable[..., Any]:
  """See :meth:`dmuon_jax.Dedication.block`."""
  b = boundary_index(ded, boundary, scanned=False)
  g = _gather.group_of(ded, b)
  if len(ded.groups[g]) > 1:
    raise ValueError(
      f'dmuon: boundary {boundary!r} is gathered together with '
      f'{[ded.boundaries.names[i] for i in ded.groups[g]]} '
      f'(layers_per_gather={ded.layers_per_gather}); run them with '
      'Dedication.sequential.'
    )
  return run_group(ded, g, lambda trees, *args: fn(trees[0], *args))


def _chain(fn: Callable[[Any, Any], Any]) -> Callable[[list, Any], Any]:
  """``(trees, x) -> fn(trees[-1], ... fn(trees[0], x))``."""
  return lambda trees, x: functools.reduce(lambda x, t: fn(t, x), trees, x)


def sequential(
  ded, fn: Callable[[Any, Any], Any], boundaries: Sequence[str]
) -> Callable[[Any, Any], Any]:
  """See :meth:`dmuon_jax.Dedication.sequential`."""
  idx = [boundary_index(ded, name, scanned=False) for name in boundaries]
  calls = []
  while idx:
    g = _gather.group_of(ded, idx[0])
    size = len(ded.groups[g])
    if tuple(idx[:size]) != ded.groups[g]:
      raise ValueError(
        f'dmuon: boundaries {list(boundaries)} split the gather group '
        f'{[ded.boundaries.names[i] for i in ded.groups[g]]}; pass '
        'whole groups, in order.'
      )
    calls.append(run_group(ded, g, _chain(fn)))
    idx = idx[size:]
  return lambda dedicated, x: functools.reduce(
    lambda x, c: c(dedicated, x), calls, x
  )


def scan(
  ded, fn: Callable[[Any, Any], Any], boundary: str
) -> Callable[[Any, Any], Any]:
  """See :meth:`dmuon_jax.Dedication.scan`."""
  b = boundary_index(ded, boundary, scanned=True)
  return run_group(ded, _gather.group_of(ded, b), _chain(fn))
