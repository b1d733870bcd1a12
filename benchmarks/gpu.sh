#!/usr/bin/env bash
# The GPU figures of docs/performance.md and docs/language-models.md in at most SECONDS
# (default 900), each benchmark under its own time limit so that one slow compile cannot take
# the others' time. The runs, in this order (name, cap in seconds):
#
#   transformers_gpt2 (190)  transformers.py at GPT-2 small's shape (vocab 50257, 128 tokens,
#       width 768, 12 blocks, batch 16): non-private, vmap and ghost private gradients, float32
#       and bf16;
#   transformers (220)  transformers.py on the guide ViT and the byte LM, the same methods and
#       policies;
#   peers (240)  peers.py: the whole private step (dpmp's default, and with a float32 sum)
#       against Opacus's hooks and ghost modes, torch on the same GPU, for the byte LM and the
#       guide ViT, float32 (torch in TF32);
#   peers_bf16 (240)  the same with dpmp's bf16 policy and torch under bf16 autocast;
#   profile (180)  step_profile.py: the non-private and the private step of the byte LM and
#       the guide ViT under jax.profiler, kernel time by stage (forward/backward, norms,
#       clipped sum, noise, optimizer) against the device's busy time and the step's wall time;
#   profile_bf16 (180)  the same in bf16;
#   profile_host (4 x 130)  the guide ViT's f32 profile four ways: as is, with donated
#       state (--donate), without CUDA graphs (--xla xla_gpu_enable_command_buffer=), and
#       both: whether the host's updates of the step's CUDA graph (9.3 ms a step on the
#       H100) are what its wall time waits on (not in the default list);
#   transformers_lm (150)  the transformers run on the byte LM alone (not in the default list:
#       transformers includes it);
#   gpt2 (600)  gpt2.py: private LoRA and full fine-tuning steps of a random GPT-2 small
#       checkpoint against non-private ones (bf16 policy).
#
# On an H100 transformers_gpt2, transformers and gpt2 took about 150, 190 and 180 s (mostly
# compiling), peers_bf16 231 s, and peers ran past its 240 s in its guide ViT (which took 137 s
# alone); with less time the later ones are cut or left out. peers.py's
# --models gpt2 adds the GPT-2 shape (on the H100 its steps were not ready 90 s after it
# started).
#
# Usage: benchmarks/gpu.sh OUTDIR [SECONDS [RUN...]] (RUN: the names above; default all); the
# JSON files and log.txt go to OUTDIR. Run from the repository root with dpmp importable
# (pip install -e . or PYTHONPATH=.) and, for the peers runs, torch with CUDA and opacus.
set -u
out=${1:?usage: benchmarks/gpu.sh OUTDIR [SECONDS]}
budget=${2:-900}
shift $(($# < 2 ? $# : 2))
wanted=" ${*:-transformers_gpt2 transformers peers peers_bf16 profile profile_bf16 gpt2} "
mkdir -p "$out"
exec > >(tee "$out/log.txt") 2>&1
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

run() {  # NAME CAP COMMAND...: at most CAP seconds, and never past the budget
    local name=$1 cap=$2 left t
    shift 2
    [[ $wanted == *" $name "* ]] || return 0
    left=$((budget - SECONDS))
    t=$((cap < left ? cap : left))
    if [ "$t" -lt 30 ]; then
        echo "== $name: not run, ${left} s of the budget left"
        return
    fi
    echo "== $name (at most $t s, at ${SECONDS} s): $*"
    # progress lines end in a carriage return: keep the log to whole lines
    timeout -k 10 "$t" "$@" 2>&1 | tr '\r' '\n' | grep -v -e 'compiling \.\.\.' -e 'first steps' -e '^ *$'
    echo "== $name: exit ${PIPESTATUS[0]} at ${SECONDS} s"
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
$py -c "import jax, torch; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__)"

gpt2_shape=(--lm-vocab 50257 --lm-context 128 --lm-width 768 --lm-mlp 3072 --lm-heads 12
    --lm-depth 12 --lm-batch 16)
methods=nonprivate,dpmp_vmap,dpmp_ghost
run transformers_gpt2 190 $py benchmarks/transformers.py --models lm "${gpt2_shape[@]}" \
    --methods $methods --repeats 3 --no-check --json "$out/transformers_gpt2.json"
run transformers 220 $py benchmarks/transformers.py --methods $methods --repeats 3 --no-check \
    --json "$out/transformers.json"
peer_variants=jax_nonprivate,dpmp,dpmp_f32sum,torch_nonprivate,opacus_hooks,opacus_ghost
for policy in f32 bf16; do
    name=peers$([ $policy = bf16 ] && echo _bf16)
    run $name 240 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 $py benchmarks/peers.py \
        --models lm,guide_vit --repeats 3 --policy $policy --variants $peer_variants \
        --json "$out/$name.json"
done
for policy in f32 bf16; do
    name=profile$([ $policy = bf16 ] && echo _bf16)
    run $name 180 $py benchmarks/step_profile.py --models lm,guide_vit --policy $policy \
        --json "$out/step_$name.json"
done
no_graphs=(--xla xla_gpu_enable_command_buffer=)
for variant in plain donate no_graphs donate_no_graphs; do
    flags=()
    [[ $variant == *donate* ]] && flags+=(--donate)
    [[ $variant == *no_graphs ]] && flags+=("${no_graphs[@]}")
    run profile_host 130 $py benchmarks/step_profile.py --models guide_vit --steps 5 \
        "${flags[@]}" --json "$out/step_profile_host_$variant.json"
done
run transformers_lm 150 $py benchmarks/transformers.py --models lm --methods $methods \
    --repeats 3 --no-check --json "$out/transformers_lm.json"
run gpt2 600 $py benchmarks/gpt2.py --rows lora full --time 5 --rounds 1 --json "$out/gpt2.json"
echo "== done at ${SECONDS} s"
