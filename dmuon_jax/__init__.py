"""dmuon_jax: distributed Muon for JAX, each matrix owned by one device."""

from optax.contrib import MuonDimensionNumbers as MuonDimensionNumbers

from dmuon_jax import checkpoint as checkpoint
from dmuon_jax import diagnostics as diagnostics
from dmuon_jax._alias import dedicated_muon as dedicated_muon
from dmuon_jax._alias import dmuon as dmuon
from dmuon_jax._alias import muon_labels as muon_labels
from dmuon_jax._alias import routing_summary as routing_summary
from dmuon_jax._assign import plan_ownership as plan_ownership
from dmuon_jax._checks import DMuonWarning as DMuonWarning
from dmuon_jax._checks import HookBoundaries as HookBoundaries
from dmuon_jax._checks import find_hook_boundaries as find_hook_boundaries
from dmuon_jax._dedicated import dedicate as dedicate
from dmuon_jax._dedication import DedicatedMuonState as DedicatedMuonState
from dmuon_jax._dedication import DedicatedParams as DedicatedParams
from dmuon_jax._dedication import Dedication as Dedication
from dmuon_jax._dedication import (
  scale_by_dedicated_muon as scale_by_dedicated_muon,
)
from dmuon_jax._newton_schulz import NS_COEFF_PRESETS as NS_COEFF_PRESETS
from dmuon_jax._newton_schulz import (
  orthogonality_error as orthogonality_error,
)
from dmuon_jax._newton_schulz import (
  orthogonalize_via_gram_newton_schulz as orthogonalize_via_gram_newton_schulz,
)
from dmuon_jax._newton_schulz import (
  orthogonalize_via_gram_newton_schulz_tp as orthogonalize_via_gram_newton_schulz_tp,
)
from dmuon_jax._newton_schulz import (
  orthogonalize_via_newton_schulz as orthogonalize_via_newton_schulz,
)
from dmuon_jax._newton_schulz import resolve_ns_coeffs as resolve_ns_coeffs
from dmuon_jax._owner_layout import OwnerBuffers as OwnerBuffers
from dmuon_jax._owner_layout import OwnerLayout as OwnerLayout
from dmuon_jax._plan import OwnerGroup as OwnerGroup
from dmuon_jax._plan import OwnershipPlan as OwnershipPlan
from dmuon_jax._routing import default_muon_predicate as default_muon_predicate
from dmuon_jax._steps import local_value_and_grad as local_value_and_grad
from dmuon_jax._steps import mean_over_devices as mean_over_devices
from dmuon_jax._transform import ScaleByDMuonState as ScaleByDMuonState
from dmuon_jax._transform import owner_layouts as owner_layouts
from dmuon_jax._transform import scale_by_dmuon as scale_by_dmuon
from dmuon_jax._transform import scale_by_shape as scale_by_shape
from dmuon_jax.checkpoint import PortableDMuonState as PortableDMuonState
from dmuon_jax.checkpoint import state_from_portable as state_from_portable
from dmuon_jax.checkpoint import state_to_portable as state_to_portable
from dmuon_jax.diagnostics import Collective as Collective
from dmuon_jax.diagnostics import HloReport as HloReport
from dmuon_jax.diagnostics import analyze as analyze_hlo
from dmuon_jax.diagnostics import analyze_compiled as analyze_compiled

__version__ = '0.2.0'

__all__ = (
  'Collective',
  'DMuonWarning',
  'DedicatedMuonState',
  'DedicatedParams',
  'Dedication',
  'HloReport',
  'HookBoundaries',
  'MuonDimensionNumbers',
  'NS_COEFF_PRESETS',
  'OwnerBuffers',
  'OwnerLayout',
  'OwnerGroup',
  'OwnershipPlan',
  'PortableDMuonState',
  'ScaleByDMuonState',
  'analyze_compiled',
  'analyze_hlo',
  'checkpoint',
  'dedicate',
  'dedicated_muon',
  'default_muon_predicate',
  'diagnostics',
  'dmuon',
  'find_hook_boundaries',
  'local_value_and_grad',
  'mean_over_devices',
  'muon_labels',
  'orthogonality_error',
  'orthogonalize_via_gram_newton_schulz',
  'orthogonalize_via_gram_newton_schulz_tp',
  'orthogonalize_via_newton_schulz',
  'owner_layouts',
  'plan_ownership',
  'routing_summary',
  'resolve_ns_coeffs',
  'scale_by_dedicated_muon',
  'scale_by_dmuon',
  'scale_by_shape',
  'state_from_portable',
  'state_to_portable',
)
