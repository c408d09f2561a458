"""Compile-only: dmuon's update on abstract FSDP params at many devices.

Run by ``tests/scale_compile_test.py`` in a fresh process (its own device
count). The state comes from ``jax.eval_shape(opt.init, abstract_params)``
(nothing allocated), the update is compiled from abstract values, and the
compiled HLO is compared with the layout's predicted owner routes.
Prints one JSON line per mesh kind.

    python tests/workers/eval_shape_at_scale.py --devices 64
"""

import argparse
import json


def main():
  p = argparse.ArgumentParser()
  p.add_argument('--devices', type=int, default=64)
  p.add_argument('--layers', type=int, default=4)
  p.add_argument('--d-model', type=int, default=512)
  p.add_argument('--d-ff', type=int, default=1536)
  args = p.parse_args()
  import jax  # pylint: disable=g-import-not-at-top

  jax.config.update('jax_num_cpu_devices', args.devices)
  jax.config.update('jax_platforms', 'cpu')
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import (
    AxisType,  # pylint: disable=g-import-not-at-top
    NamedSharding,  # pylint: disable=g-import-not-at-top
  )
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import dmuon_jax  # pylint: disable=g-import-not-at-top

  d, f = args.d_model, args.d_ff
  shapes = {
    f'layers_{i}': {
      'q': (d, d),
      'k': (d, d),
      'v': (d, d),
      'o': (d, d),
      'gate': (d, f),
      'up': (d, f),
      'down': (f, d),
    }
    for i in range(args.layers)
  }
  n = args.devices
  for kind in (AxisType.Explicit, AxisType.Auto):
    mesh = jax.make_mesh(
      (n // 8, 8), ('replicate', 'shard'), axis_types=(kind, kind)
    )
    # HSDP: rows over 'shard' (FSDP inside a replica), replicated over
    # 'replicate'.
    shardings = jax.tree.map(
      lambda s, mesh=mesh: NamedSharding(mesh, P('shard')),
      shapes,
      is_leaf=lambda s: isinstance(s, tuple),
    )
    abstract = jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s, jnp.float32, sharding=sh),
      shapes,
      shardings,
      is_leaf=lambda s: isinstance(s, tuple),
    )
    specs = shardings if kind == AxisType.Auto else None
    opt = dmuon_jax.dmuon(0.02, mesh=mesh, param_specs=specs)
    state = jax.eval_shape(opt.init, abstract)
    (layout,) = dmuon_jax.owner_layouts(state)
    is_buffers = lambda x: isinstance(x, dmuon_jax.OwnerBuffers)
    # eval_shape keeps shardings on Explicit meshes only (Auto: None); the
    # layout knows where its buffers go, the rest is replicated.
    (buffers,) = [
      x for x in jax.tree.leaves(state, is_leaf=is_buffers) if is_buffers(x)
    ]
    abstract_specs = [
      None if b.sharding is None else str(b.sharding.spec) for b in buffers
    ]

    def place(x, mesh=mesh, is_buffers=is_buffers):
      if is_buffers(x):
        return dmuon_jax.OwnerBuffers(
          [
            jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=s)
            for b, s in zip(x.buffers, x.layout.shardings(mesh))
          ],
          x.layout,
        )
      return jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(mesh, P())
      )

    like = jax.tree.map(place, state, is_leaf=is_buffers)
    report = dmuon_jax.analyze_hlo(opt.update, abstract, like, abstract)
    predicted = layout.collective_bytes()
    print(
      json.dumps(
        {
          'devices': n,
          'mesh_kind': str(kind),
          'layout': layout.name,
          'param_entries_known': all(
            e is not None for e in layout.param_entries
          ),
          'eval_shape_buffer_specs': abstract_specs,
          'layout_buffer_specs': [str(s) for s in layout.buffer_specs()],
          'bytes_by_kind': report.bytes_by_kind,
          'predicted': predicted,
        }
      ),
      flush=True,
    )


if __name__ == '__main__':
  main()
