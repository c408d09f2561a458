"""What dmuon tells the user: the routing log line and its warnings."""

from __future__ import annotations

import logging
import warnings

from dmuon_jax import _routing

LOGGER = logging.getLogger('dmuon_jax')

NO_MUON_MSG = (
  'dmuon: no leaf goes to Muon, so every leaf is updated by AdamW (at'
  ' adam_learning_rate, which defaults to learning_rate). {rule}{summary}.'
  " Pass predicate='optax' (every 2-D leaf, as optax.contrib.muon), your own"
  ' predicate, or muon_weight_dimension_numbers (which stacked and'
  ' attention leaves need); if AdamW alone is meant, use optax.adamw.'
)


class DMuonWarning(UserWarning):
  """A warning that dmuon does less than it could.

  Raised (with ``warnings.warn``) when the optimizer communicates more
  than needed (params sharded along a stack axis gathered whole, shardings
  ``init`` could not see treated as replicated) or routes no leaf to Muon.
  The message says why and what to pass instead. It is a ``UserWarning``;
  ``warnings.simplefilter('error', dmuon_jax.DMuonWarning)`` makes it an
  error, e.g. in tests.

  Attributes:
    args: a 1-tuple holding the message.

  Examples:
    >>> import warnings, jax.numpy as jnp, dmuon_jax
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter('always')
    ...   _ = dmuon_jax.dmuon(0.02).init({'bias': jnp.zeros(8)})  # no matrix
    >>> [w.category.__name__ for w in caught]
    ['DMuonWarning']
    >>> print(caught[0].message.args[0][:47])
    dmuon: no leaf goes to Muon, so every leaf is u
  """


def report_routing(routing: _routing.Routing) -> None:
  """Logs the routing summary at INFO; warns if no leaf goes to Muon."""
  LOGGER.info('%s', routing.summary)
  if routing.num_muon == 0:
    rule = (
      'The default rule (dmuon_jax.default_muon_predicate) takes 2-D'
      ' matrices with both dims > 1 that are not embeddings, heads, norms'
      ' or biases. '
      if routing.default_rule
      else ''
    )
    warnings.warn(
      NO_MUON_MSG.format(rule=rule, summary=routing.summary),
      DMuonWarning,
      stacklevel=4,
    )
