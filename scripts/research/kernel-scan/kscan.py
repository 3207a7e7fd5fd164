"""Prototype: compile vLLM's _lora_expand_kernel for sm_90 and count register-A wgmma overwrites."""

import ast, inspect, os, subprocess, sys, tempfile, importlib.util, itertools

src_dir = sys.argv[1]
here = os.path.dirname(os.path.abspath(__file__))
out = ["import triton", "import triton.language as tl", ""]
for fname, names in (("kernel_utils.py", None), ("lora_expand_op.py", {"_lora_expand_kernel"})):
    src = open(os.path.join(src_dir, fname)).read().splitlines()
    for node in ast.parse("\n".join(src)).body:
        if (
            isinstance(node, ast.FunctionDef)
            and node.decorator_list
            and ast.unparse(node.decorator_list[0]) == "triton.jit"
        ):
            if names is None or node.name in names:
                out += src[node.decorator_list[0].lineno - 1 : node.end_lineno] + [""]
tmp = tempfile.mkdtemp()
open(f"{tmp}/kern.py", "w").write("\n".join(out))
sys.path.insert(0, tmp)
import triton, kern
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget

bindir = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
print("triton", triton.__version__, "bin:", sorted(os.listdir(bindir)))
ptxas = os.environ.get("TRITON_PTXAS_PATH") or os.path.join(bindir, "ptxas")
print(
    subprocess.run([ptxas, "--version"], capture_output=True, text=True)
    .stdout.strip()
    .splitlines()[-1]
)
fn = kern._lora_expand_kernel
names = list(inspect.signature(fn.fn).parameters)
for bn, ns, in_dt, addin in itertools.product(
    (128, 64, 32), (2, 1), ("fp32", "bf16"), (False, True)
):
    sig = dict(
        input_ptr="*" + in_dt,
        lora_ptr="*bf16",
        out_ptr="*bf16",
        M="i32",
        N="i32",
        K="i32",
        token_indices_sorted_by_lora_ids="*i32",
        num_tokens_per_lora="*i32",
        lora_token_start_loc="*i32",
        lora_ids="*i32",
        slice_start_loc="i32",
        input_d0_stride="i32",
        input_d1_stride="i32",
        ls_d0_ptr="i32",
        ls_d1_ptr="i32",
        output_d0_stride="i32",
        output_hs_ptr="i32",
    )
    consts = dict(
        input_d2_stride=1,
        ls_d2_ptr=1,
        output_d1_stride=1,
        BLOCK_M=64,
        BLOCK_N=bn,
        BLOCK_K=32,
        EVEN_K=True,
        ADD_INPUTS=addin,
        CAST_TYPE=in_dt == "fp32",
        SLICE_NUM=1,
        SAME_STRIDE=True,
        USE_GDC=False,
        launch_pdl=False,
    )
    for k in consts:
        sig[k] = "constexpr"
    div = [n for n in sig if sig[n] != "constexpr" and n not in ("M", "slice_start_loc")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div}
    try:
        ck = triton.compile(
            ASTSource(fn, sig, consts, attrs),
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=4, num_stages=ns, num_ctas=1),
        )
    except Exception as e:
        print(bn, ns, in_dt, addin, "COMPILE FAILED", type(e).__name__, str(e)[:200])
        continue
    cubin = f"{tmp}/k.cubin"
    open(cubin, "wb").write(ck.asm["cubin"])
    sass = subprocess.run(
        [os.path.join(bindir, "cuobjdump"), "-sass", cubin], capture_output=True, text=True
    ).stdout
    open(f"{tmp}/k.sass", "w").write(sass)
    res = subprocess.run(
        [sys.executable, os.path.join(here, "haz.py"), f"{tmp}/k.sass"],
        capture_output=True,
        text=True,
    ).stdout
    hg = sum(1 for l in sass.splitlines() if "HGMMA" in l)
    regA = sum(
        1
        for l in sass.splitlines()
        if "HGMMA" in l and ", R" in l.split("HGMMA")[1].split(",")[1]
        if False
    )
    loops = [l for l in res.splitlines() if " loop " in l]
    print(
        f"block_n {bn:3d} stages {ns} input {in_dt} add_inputs {int(addin)}: HGMMA {hg}, register-A {sum(1 for l in sass.splitlines() if 'HGMMA' in l and l.split(',')[1].strip().startswith('R'))}, ",
        "; ".join(x.split(" ", 1)[1] for x in loops) or "no wgmma loop",
    )
