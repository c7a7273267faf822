source benchmarks/device/setup.sh
build_cpu_library
M=/tmp/qwen3-12l-q8_0.gguf
[ -f $M ] || python3 -m freetoken.cli synth --preset qwen3-30b-a3b --layers 12 --expert-format q8_0 --device cuda --out $M 2>&1 | tail -1
ps aux --sort=-%cpu | head -5
for i in 1 2; do
PYTHONPATH=$PWD/.peer/site:$PYTHONPATH python3 benchmarks/cpu_peer.py --model $M --threads 16 --tokens 32 --engines cpu_dense_pool --label qwen3-12layers-q8_0-16cores-h200 --out "$OUT" 2>&1 | grep -E '"tokens_per_s"|ratio'
done
