"""The documentation's code runs, and its links resolve.

Every guide (``docs/guides/*.md`` but the index) is one test,
``GuideTest::test_guide_runs_<name>`` (``pytest -k nnx``): its ``python``
code blocks run in order, in one fresh namespace, in this process (the
suite's 8 simulated CPU devices, see ``conftest.py``). A guide ends with
asserts on real results (parity with ``optax.contrib.muon``, a restored
state equal to the saved one), so a guide whose code raises or whose
numbers drift fails its test. A block may be left out only with a reason,
written just before it as ``<!-- skip: reason -->``.

A guide whose blocks are files (each a ``{code-block} python`` with
``:caption: path``; the chex guide: a ``conftest.py`` that calls
``chex.set_n_cpu_devices(8)``, which must run before JAX starts, and a test
file) is written to a temporary directory and run there by pytest in a
fresh process, as its reader would run it.

The multi-host guide shows ``examples/multihost.py`` (``literalinclude``)
and its launch command; that script is run, with 2 processes x 4 devices
against 1 x 8, by ``tests/multihost_test.py``. Its guide test runs only
the guide's single-process block.
"""

import dataclasses
import pathlib
import re
import subprocess
import sys
import tempfile
import time

from absl.testing import absltest, parameterized

from tests import support

# Each guide compiles its own programs (measured 42 s of the inner loop's
# 200 s of worker time); the full suite runs every guide, the inner loop
# checks the links.
SLOW_CASES = (r'GuideTest::',)

ROOT = support.ROOT
DOCS = ROOT / 'docs'
GUIDES = sorted(p for p in (DOCS / 'guides').glob('*.md') if p.stem != 'index')
PAGES = sorted(p for p in DOCS.rglob('*.md') if '_build' not in p.parts)

FENCE = re.compile(r'^(`{3,}|:{3,})\s*(.*?)\s*$')
SKIP = re.compile(r'^<!--\s*skip:\s*(.*?)\s*-->$')
OPTION = re.compile(r'^:(\w[\w-]*):\s*(.*?)\s*$')


@dataclasses.dataclass
class Block:
  """One ``python`` code block of a page."""

  line: int  # 1-based line of its opening fence
  code: str
  skip: str | None  # the stated reason, if skipped
  file: str | None  # its ``:caption:``: the file it is


def code_blocks(text: str) -> list[Block]:
  """The ``python`` blocks of a MyST page, in order (also inside
  directives): fenced ```` ```python ```` and ```` ```{code-block} python
  ````. A ``<!-- skip: reason -->`` line just before a block marks it."""
  lines = text.splitlines()
  blocks, stack = [], []  # stack: (fence, info, first line, body)
  for i, line in enumerate(lines):
    m = FENCE.match(line)
    if stack and m and not m.group(2) and m.group(1)[0] == stack[-1][0][0]:
      if len(m.group(1)) >= len(stack[-1][0]):
        _, info, start, body = stack.pop()
        language = info.removeprefix('{code-block}').strip()
        if language in ('python', 'py', 'python3'):
          options = {}
          while body and OPTION.match(body[0]):
            key, value = OPTION.match(body.pop(0)).groups()
            options[key] = value
          while body and not body[0].strip():
            body.pop(0)
          prev = next(
            (s for s in (x.strip() for x in reversed(lines[:start])) if s), ''
          )
          skip = SKIP.match(prev)
          blocks.append(
            Block(
              line=start + 1,
              code='\n'.join(body) + '\n',
              skip=skip.group(1) if skip else None,
              file=options.get('caption'),
            )
          )
        continue
    if m and (not stack or stack[-1][1].startswith('{')) and m.group(2):
      stack.append((m.group(1), m.group(2), i, []))
    elif stack:
      stack[-1][3].append(line)
  return blocks


def run_in_process(path: pathlib.Path, blocks: list[Block]) -> None:
  """Runs the blocks in order in one fresh namespace; what they write with
  ``tempfile`` (checkpoints) goes to a directory removed afterwards."""
  namespace = {'__name__': f'docs_guide_{path.stem}'}
  with tempfile.TemporaryDirectory(prefix=f'guide-{path.stem}-') as tmp:
    saved, tempfile.tempdir = tempfile.tempdir, tmp
    try:
      for block in blocks:
        if block.skip is None:
          where = f'{path.relative_to(ROOT)}:{block.line}'
          try:
            exec(compile(block.code, where, 'exec'), namespace)  # noqa: S102
          except BaseException as e:
            e.add_note(f'in the code block at {where}')
            raise
    finally:
      tempfile.tempdir = saved


def run_as_project(path: pathlib.Path, blocks: list[Block]) -> str:
  """Writes the blocks as the files their captions name, then runs pytest
  on them in a fresh process; returns its output."""
  with tempfile.TemporaryDirectory(prefix=f'guide-{path.stem}-') as tmp:
    files = {}
    for block in blocks:
      if block.skip is None:
        files.setdefault(block.file, []).append(block.code)
    for name, parts in files.items():
      target = pathlib.Path(tmp, name)
      target.parent.mkdir(parents=True, exist_ok=True)
      target.write_text('\n'.join(parts))
    # An empty ini: the guide's project, not this repository's settings.
    pathlib.Path(tmp, 'pytest.ini').write_text('[pytest]\n')
    env = support.subprocess_env()
    proc = subprocess.run(
      [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', tmp],
      cwd=tmp,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
      check=False,
    )
  out = proc.stdout + proc.stderr
  if proc.returncode:
    raise AssertionError(f'{path.name}: pytest failed:\n{out}')
  return out


class CodeBlocksTest(absltest.TestCase):
  """The extractor itself (a guide test that finds no code would pass)."""

  def test_blocks_options_skips_and_nesting(self):
    text = '\n'.join(
      [
        '# T',
        '```python',
        'a = 1',
        '```',
        '<!-- skip: needs two processes -->',
        '',
        '```python',
        'b = 2',
        '```',
        '```bash',
        'echo no',
        '```',
        '````{note}',
        '```{code-block} python',
        ':caption: conftest.py',
        'c = 3',
        '```',
        '````',
      ]
    )
    a, b, c = code_blocks(text)
    self.assertEqual((a.code, a.skip, a.file), ('a = 1\n', None, None))
    self.assertEqual((b.code, b.skip), ('b = 2\n', 'needs two processes'))
    self.assertEqual((c.code, c.file), ('c = 3\n', 'conftest.py'))


class GuideTest(parameterized.TestCase):
  @parameterized.named_parameters((p.stem, p) for p in GUIDES)
  def test_guide_runs(self, path):
    blocks = code_blocks(path.read_text())
    runnable = [b for b in blocks if b.skip is None]
    self.assertNotEmpty(runnable, f'{path.name}: no code to run')
    for b in blocks:
      self.assertTrue(b.skip is None or b.skip, f'{path.name}:{b.line}')
    start = time.perf_counter()
    if any(b.file for b in runnable):
      self.assertTrue(all(b.file for b in runnable), path.name)
      out = run_as_project(path, blocks)
      self.assertRegex(out, r'\d+ passed')
      self.assertNotRegex(out, r'\d+ (failed|skipped|error)')
    else:
      run_in_process(path, blocks)
    print(f'{path.name}: {time.perf_counter() - start:.1f} s')


# -- links ----------------------------------------------------------------------

LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)')
DIRECTIVE_PATH = re.compile(
  r'^(?:`{3,}|:{3,})\{(?:include|literalinclude|image|figure)\}\s+(\S+)', re.M
)
DOC_ROLE = re.compile(r'\{doc\}`(?:[^`<]*<)?([^`<>]+)>?`')
LITERALINCLUDE = re.compile(
  r'^`{3,}\{literalinclude\}\s+(\S+)\n((?::[\w-]+:.*\n)*)', re.M
)
HEADING = re.compile(r'^(#{1,6})\s+(.*?)\s*#*\s*$', re.M)
CODE = re.compile(r'(?ms)^(`{3,}).*?^\1\s*$')


def slug(heading: str) -> str:
  """GitHub's (and MyST's ``myst_heading_anchors``) anchor of a heading."""
  text = re.sub(r'[`*_]|\[([^\]]*)\]\([^)]*\)', r'\1', heading.strip())
  text = re.sub(r'[^\w\- ]', '', text.lower())
  return text.replace(' ', '-')


def anchors(path: pathlib.Path) -> set[str]:
  text = CODE.sub('', path.read_text())
  return {slug(m.group(2)) for m in HEADING.finditer(text)}


def links(path: pathlib.Path) -> list[str]:
  """Markdown links and images outside code, and the files of directives."""
  text = path.read_text()
  prose = re.sub(r'`[^`\n]*`', '', CODE.sub('', text))
  return LINK.findall(prose) + DIRECTIVE_PATH.findall(text)


class LinkTest(parameterized.TestCase):
  """Every relative link, image and included file of ``README.md`` and the
  docs pages exists (and a ``#anchor`` is a heading of its page); absolute
  links are checked for form only (CI has no network). ``{doc}`` roles name
  pages that exist, and ``literalinclude`` ranges match their file."""

  @parameterized.named_parameters(
    (str(p.relative_to(ROOT)).replace('/', '_').removesuffix('.md'), p)
    for p in [ROOT / 'README.md', *PAGES]
  )
  def test_links_resolve(self, path):
    name = path.relative_to(ROOT)
    for target in links(path):
      if re.match(r'[a-z][a-z0-9+.-]*:', target):
        self.assertRegex(target, r'^(https?://[^\s/]+\.[^\s]+|mailto:\S+@)')
        continue
      file, _, anchor = target.partition('#')
      dest = (path.parent / file).resolve() if file else path
      self.assertTrue(dest.exists(), f'{name}: {target} ({dest})')
      if anchor and dest.suffix == '.md':
        self.assertIn(anchor, anchors(dest), f'{name}: {target}')
    for target in DOC_ROLE.findall(path.read_text()):
      base = DOCS if target.startswith('/') else path.parent
      dest = base / f'{target.lstrip("/")}.md'
      self.assertTrue(dest.exists(), f'{name}: {{doc}}`{target}` ({dest})')

  @parameterized.named_parameters(
    (str(p.relative_to(ROOT)).replace('/', '_').removesuffix('.md'), p)
    for p in PAGES
    if LITERALINCLUDE.search(p.read_text())
  )
  def test_literalinclude_ranges_exist(self, path):
    for file, options in LITERALINCLUDE.findall(path.read_text()):
      source = (path.parent / file).read_text()
      for key, value in re.findall(r'^:([\w-]+):\s*(.*?)\s*$', options, re.M):
        value = value.strip('"\'')
        if key in ('start-after', 'start-at', 'end-before', 'end-at'):
          self.assertIn(value, source, f'{path.name}: {key} {value!r}')
        elif key == 'pyobject':
          self.assertRegex(source, rf'(?m)^(def|class) {value}\b', path.name)


if __name__ == '__main__':
  absltest.main()
