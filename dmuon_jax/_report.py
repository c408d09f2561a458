"""What dmuon tells the user: the routing log line and its warnings."""

from __future__ import annotations

import logging
import warnings

from dmuon_jax import _planner

LOGGER = logging.getLogger('dmuon_jax')

NO_MUON_MSG = (
  'dmuon: no leaf goes to Muon, so every leaf is updated by AdamW (at'
  ' adam_learning_rate, which defaults to learning_rate). {rule}{summary}.'
  " Pass predicate='optax' (every 2-D leaf, as optax.contrib.muon), your own"
  ' predicate, or muon_weight_dimension_numbers (which stacked and'
  ' attention leaves need); if AdamW alone is meant, use optax.adamw.'
)


class DMuonWarning(UserWarning):
  """A warning that dmuon does less than it could: it communicates more
  than needed, or routes no leaf to Muon (the message says why and what to
  do)."""


def report_routing(routing: _planner.Routing) -> None:
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
