"""The two adjustments SGLang 0.5.23 needs to import on CPU beside torch 2.13.0+cpu (run by build.sh
inside the venv; idempotent).

1. ``sgl_kernel``: SGLang imports a few names from its CUDA kernel package at module load, none of
   which the dense fp32 CPU path calls. The stand-in package next to this file provides exactly
   those names, each raising ``NotImplementedError`` if called; it is copied into site-packages.
2. ``torchvision`` (imported at load by SGLang's multimodal configs): the registry build's C ops do
   not load beside a +cpu torch, yet two of its fake-op registrations (``nms``, ``qnms``) run
   unconditionally and fail the import. They are made to register only when the ops loaded, as
   every other registration in that file already does; the ops themselves still raise if used.
3. SGLang's LoRA layers and torch LoRA backend allocate pinned host memory unconditionally
   (``pin_memory=True``, ``.pin_memory()``), which raises without CUDA. Pinned memory only
   speeds host-to-GPU copies, and this venv has no GPU: those allocations become plain ones.

Raises:
    SystemExit: the torchvision file no longer has the expected lines (a different version).
"""

import re
import shutil
import sysconfig
from pathlib import Path

site = Path(sysconfig.get_paths()["purelib"])
here = Path(__file__).resolve().parent

dest = site / "sgl_kernel"
if dest.exists():
    shutil.rmtree(dest)
shutil.copytree(here / "sgl_kernel", dest, ignore=shutil.ignore_patterns("__pycache__"))

meta = site / "torchvision" / "_meta_registrations.py"
text = meta.read_text()
pattern = re.compile(r'^@torch\.library\.register_fake\("torchvision::(q?nms)"\)$', re.M)
if pattern.search(text):
    text = pattern.sub(r'@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() '
                       r'else (lambda fn: fn))', text)
    meta.write_text(text)
elif "torchvision.extension._has_ops() else (lambda fn: fn)" not in text:
    raise SystemExit(f"{meta}: the nms/qnms fake registrations were not found; torchvision version changed?")
lora_files = [site / "sglang" / "srt" / "lora" / "layers.py", site / "sglang" / "srt" / "lora" / "backend" / "torch_backend.py"]
for f in lora_files:
    text = f.read_text()
    if "pin_memory=True" in text or ".pin_memory()" in text:
        f.write_text(text.replace("pin_memory=True", "pin_memory=False").replace(".pin_memory()", ""))
    elif "pin_memory=False" not in text:
        raise SystemExit(f"{f}: no pinned allocation found to adjust; sglang version changed?")
print(f"sgl_kernel stand-in -> {dest}; torchvision meta registrations and SGLang's LoRA pinned memory adjusted")
