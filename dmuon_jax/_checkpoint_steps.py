"""dmuon_jax.checkpoint step directories: complete steps, numbers, roots."""

from __future__ import annotations

import os
import pathlib

import jax.numpy as jnp
import numpy as np

# Documented as dmuon_jax.checkpoint.COMMIT_MARKER.
COMMIT_MARKER = 'commit_success.txt'


def complete_steps(directory) -> list[int]:
  """Steps under ``directory`` whose save completed (sorted).

  A step counts only if its directory name is an integer and holds orbax's
  commit marker (``commit_success.txt``, written just before the atomic
  rename of the temporary directory, or as the last file on file systems
  without atomic rename). Temporary (``*.orbax-checkpoint-tmp-*``) or
  unfinished step directories are ignored.

  Args:
    directory: the checkpoint root directory (a ``str`` or ``os.PathLike``).

  Returns:
    The complete steps, ascending; ``[]`` if there are none or
    ``directory`` does not exist.

  Examples:
    >>> import pathlib, tempfile
    >>> from dmuon_jax import checkpoint
    >>> with tempfile.TemporaryDirectory() as directory:
    ...   root = pathlib.Path(directory)
    ...   for step in (10, 2, 7):
    ...     (root / str(step)).mkdir()
    ...   for step in (10, 2):  # step 7's save never committed
    ...     _ = (root / str(step) / checkpoint.COMMIT_MARKER).write_text('')
    ...   checkpoint.complete_steps(directory)
    [2, 10]
  """
  path = pathlib.Path(directory)
  if not path.is_dir():
    return []
  steps = []
  for child in path.iterdir():
    if (
      child.is_dir()
      and child.name.isdigit()
      and (child / COMMIT_MARKER).is_file()
    ):
      steps.append(int(child.name))
  return sorted(steps)


def latest_step(directory) -> int | None:
  """The latest complete step under ``directory``, or None.

  Args:
    directory: the checkpoint root directory (a ``str`` or ``os.PathLike``).

  Returns:
    The largest of :func:`complete_steps`, or None if there is none.

  Examples:
    >>> import tempfile, jax.numpy as jnp, dmuon_jax
    >>> from dmuon_jax import checkpoint
    >>> params = {'layers_0': {'w': jnp.ones((4, 8)), 'b': jnp.zeros(8)}}
    >>> state = dmuon_jax.dmuon(0.02).init(params)
    >>> with tempfile.TemporaryDirectory() as directory:
    ...   print(checkpoint.latest_step(directory))
    ...   _ = checkpoint.save(directory, 5, params, state)
    ...   print(checkpoint.latest_step(directory))
    None
    5
  """
  steps = complete_steps(directory)
  return steps[-1] if steps else None


def as_step(step, where: str) -> int:
  """``step`` as a Python int, or a TypeError/ValueError saying why not."""
  dtype = getattr(step, 'dtype', None)
  if isinstance(step, int) and not isinstance(step, bool):
    value = step
  elif (
    dtype is not None
    and np.shape(step) == ()
    and jnp.issubdtype(dtype, jnp.integer)
  ):
    value = int(step)
  else:
    what = (
      type(step).__name__
      if dtype is None
      else f'{jnp.dtype(dtype).name} array of shape {np.shape(step)}'
    )
    raise TypeError(
      f'dmuon_jax checkpoint.{where}: step={step!r} ({what}) is not an '
      'integer. Pass the training step as a '
      'non-negative int (or a 0-d integer array such as '
      'optimizer.step[...]): steps are directories named by the number, '
      'and restore only finds those named by non-negative integers.'
    )
  if value < 0:
    raise ValueError(
      f'dmuon_jax checkpoint.{where}: step={value} is negative. Pass the '
      'non-negative training step (e.g. the number of updates applied so '
      'far): restore only finds step directories named by non-negative '
      'integers, so this checkpoint would be lost.'
    )
  return value


def check_directory(directory, where: str) -> pathlib.Path:
  """The absolute root, or FileNotFoundError if it is not a directory."""
  root = pathlib.Path(os.path.abspath(directory))
  if not root.exists():
    raise FileNotFoundError(
      f'dmuon_jax checkpoint.{where}: {str(directory)!r} does not exist, so '
      'there is no checkpoint to restore. Pass the directory given to save '
      '(check the path for a typo). If starting fresh is intended, create '
      'the directory first (os.makedirs(directory, exist_ok=True): an empty '
      'directory restores as None) or check os.path.isdir(directory) before '
      'restoring.'
    )
  if not root.is_dir():
    raise FileNotFoundError(
      f'dmuon_jax checkpoint.{where}: {str(directory)!r} is a file, not a '
      'checkpoint directory. Pass the directory given to save (it holds one '
      'directory per step), not a file in it.'
    )
  return root


def check_not_a_step(root: pathlib.Path, where: str) -> None:
  """Raises if ``root`` (with no complete step) is itself a step directory."""
  if root.name.isdigit() and (root / COMMIT_MARKER).is_file():
    raise ValueError(
      f'dmuon_jax checkpoint.{where}: {str(root)!r} is the directory of '
      f'step {root.name}, not a checkpoint root. Pass its parent '
      f'{str(root.parent)!r} (the directory given to save), with '
      f'step={root.name} to restore this step.'
    )
