"""The variant seam holds: every module outside the variant folders (engram_stream/*.py, engine/,
rows/, io/, integrations/, the CLI; their .pyx/.pxd and include/'s C headers too) names no
variant in code (only in docstrings, comments and help texts, plus the documented exceptions
below), no shared file lists history rules (a rule is its variant's window class), the
package's __init__ names no variant folder, and setup.py builds every .pyx of the package with
no list of its own."""
import ast
import glob
import os
import re

from helpers.repo import ROOT

PKG = os.path.join(ROOT, "engram_stream")
VARIANT_WORD = re.compile(r"v41|deepseek|demo|qwen", re.I)
HELP_KEYWORDS = {"help", "description", "epilog"}
# Names the public contract fixes (DESIGN.md 3-5), each with why it stays (file: its path under
# engram_stream/):
ALLOWED = {
    ("model.py", "from_deepseek_v41"): "EngramModel.from_deepseek_v41, a public API name: one call into the registry",
    ("cli.py", "cmd_demo"): "the `engram-stream demo` command's function",
    ("cli.py", "demo"): "the `engram-stream demo` command's name",
    ("variants.py", "demo-v1"): "variants.DEFAULT, EngramConfig's default variant (a registry name)",
}
# Modules that bind one framework's classes of one model family: their names are the framework's.
BINDINGS = {
    "integrations/transformers.py": "transformers' DeepSeek-V4 model classes",
    "integrations/transformers_qwen.py": "transformers' Qwen4-Exp model classes",
    "integrations/vllm.py": "vLLM's DeepSeek-V4.1, Qwen4-Exp and LongCat module paths and classes",
    "integrations/sglang.py": "SGLang's DeepSeek-V4.1, Qwen4-Exp and LongCat module paths, classes and switches",
}


def variant_folders():
    return {os.path.basename(os.path.dirname(p)) for p in glob.glob(os.path.join(PKG, "*", "variant.py"))}


def shared_files(*exts):
    """Paths under engram_stream/ (posix) of every file with one of exts outside the variant
    folders, and include/'s headers (as ../include/NAME) for ".h"."""
    folders = variant_folders()
    out = []
    for ext in exts:
        for p in glob.glob(os.path.join(PKG, "**", "*" + ext), recursive=True):
            rel = os.path.relpath(p, PKG).replace(os.sep, "/")
            if rel.split("/")[0] not in folders:
                out.append(rel)
    if ".h" in exts:
        out += ["../include/" + os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "include", "*.h"))]
    return sorted(out)


def _docstring_nodes(tree):
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _help_nodes(tree):
    """Every node inside a help text: a help=/description=/epilog= argument, or a function that
    builds one (its name ends in _help)."""
    out = set()
    for node in ast.walk(tree):
        roots = []
        if isinstance(node, ast.keyword) and node.arg in HELP_KEYWORDS:
            roots.append(node.value)
        if isinstance(node, ast.FunctionDef) and node.name.endswith("_help"):
            roots.append(node)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "command" and len(node.args) >= 3:
            roots.append(node.args[2])   # cli's command(name, func, help)
        for r in roots:
            out.update(id(n) for n in ast.walk(r))
    return out


def _allowed_spans(tree, fname):
    """Nodes inside an allowed function (its name and body) of this file."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and (fname, node.name) in ALLOWED:
            out.update(id(n) for n in ast.walk(node))
    return out


def variant_words_in_code(path, fname=None):
    """(line, text) of every variant word in code: names, attributes, strings that are not a
    docstring, a help text or an allowed contract name. Comments are not in the tree.
    fname: the file's key in ALLOWED (default: its base name)."""
    fname = fname or os.path.basename(path)
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    skip = _docstring_nodes(tree) | _help_nodes(tree) | _allowed_spans(tree, fname)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        words = []
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            words.append(node.value)
        elif isinstance(node, ast.Name):
            words.append(node.id)
        elif isinstance(node, ast.Attribute):
            words.append(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            words.append(node.name)
        elif isinstance(node, ast.alias):
            words.append(node.asname or node.name)
        elif isinstance(node, ast.arg):
            words.append(node.arg)
        for w in words:
            if VARIANT_WORD.search(w) and (fname, w) not in ALLOWED:
                found.append((getattr(node, "lineno", 0), w))
    return sorted(found)


def code_of(path):
    """The code of a .pyx/.pxd/.h file: comments, docstrings and C comments blanked out."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".h"):
        text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
        return re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r'"""(.*?)"""', '""', text, flags=re.S)
    return re.sub(r"#[^\n]*", " ", text)


def test_shared_modules_name_no_variant_in_code():
    files = shared_files(".py")
    assert {"plan.py", "cli.py", "engine/decoder.py", "rows/tiers.py", "io/files.py",
            "integrations/serving.py"} <= set(files)
    bad = {f: variant_words_in_code(os.path.join(PKG, f), f) for f in files if f not in BINDINGS}
    bad = {f: w for f, w in bad.items() if w}
    assert not bad, bad


def test_shared_extensions_and_headers_name_no_variant_in_code():
    files = shared_files(".pyx", ".pxd", ".h")
    assert {"_hash.pyx", "engine/_window.pyx", "engine/_base.pxd", "rows/_cache.pyx",
            "../include/engram_hash_kern.h"} <= set(files)
    bad = {f: sorted(set(VARIANT_WORD.findall(code_of(os.path.join(PKG, f))))) for f in files}
    bad = {f: w for f, w in bad.items() if w}
    assert not bad, bad


def test_no_shared_file_lists_history_rules():
    """A history rule and a hash are their variant's window class (engine/_window.pyx's hooks):
    no code outside the variant folders names a rule or keeps a table of them."""
    rule_word = re.compile(r"HIST_|HISTORIES|latch_window|separator_window|\"(dead|separator)\"")
    found = {}
    for f in shared_files(".py", ".pyx", ".pxd", ".h"):
        path = os.path.join(PKG, f)
        code = code_of(path) if not f.endswith(".py") else _py_code(path)
        hits = sorted(set(m.group(0) for m in rule_word.finditer(code)))
        if hits:
            found[f] = hits
    assert not found, found


def _py_code(path):
    """A .py file's code with docstrings and comments out (ast round trip)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    doc = _docstring_nodes(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) in doc:
            node.value = ""
    return ast.unparse(tree)


def test_the_check_sees_a_variant_word_in_code(tmp_path):
    """The check is not blind: a name, a string and an attribute are found; a docstring, a
    comment and a help text are not."""
    p = tmp_path / "cli.py"
    p.write_text('"""The demo."""\n'
                 'import argparse  # the demo\n'
                 'def f(cfg):\n'
                 '    """For qwen."""\n'
                 '    if cfg.variant == "deepseek-v4.1":\n'
                 '        return cfg.image_token_id, demo_model\n'
                 '    argparse.ArgumentParser().add_argument("-x", help="a v41 folder")\n')
    assert variant_words_in_code(str(p)) == [(5, "deepseek-v4.1"), (6, "demo_model")]
    h = tmp_path / "k.h"
    h.write_text("/* the qwen rule */\n// v41\nint es_demo(int x); /* DeepSeek */\n")
    assert VARIANT_WORD.findall(code_of(str(h))) == ["demo"]
    x = tmp_path / "w.pyx"
    x.write_text('"""For qwen."""\n# v41\ncdef int demo_rule(int x):\n    return x\n')
    assert VARIANT_WORD.findall(code_of(str(x))) == ["demo"]


def test_the_package_init_names_no_variant_folder():
    with open(os.path.join(PKG, "__init__.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    folders = variant_folders()
    assert {"demo", "v41", "qwen"} <= folders
    doc = _docstring_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in doc:
            continue
        if isinstance(node, ast.ImportFrom):
            assert not {(node.module or "").split(".")[0]} & folders, ast.dump(node)
            assert not {a.name for a in node.names} & folders, ast.dump(node)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            assert not any(f in node.value.split(".") for f in folders), node.value


def test_setup_builds_every_pyx_with_no_list_of_its_own():
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
        text = f.read()
    assert '"**"' in text and "*.pyx" in text and "recursive=True" in text
    assert not re.search(r"engram_stream\.\w+\._\w+", text)   # no module named by hand
    code = text.split("ASAN =")[0]   # the module list, without building anything
    pyx = sorted(os.path.relpath(p, ROOT)[:-4].replace(os.sep, ".")
                 for p in glob.glob(os.path.join(PKG, "**", "*.pyx"), recursive=True))
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        ns = {}
        exec(compile(code, "setup.py", "exec"), ns)  # noqa: S102  (the repository's own file)
    finally:
        os.chdir(cwd)
    assert ns["MOD_NAMES"] == pyx and "engram_stream.engine._base" in pyx and len(pyx) >= 9
