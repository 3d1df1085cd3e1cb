"""Rebuild the embedded default assets in rollout/assets/ (dataset, tokenizer, model config).

The default job must run offline on a fresh machine, so everything it needs except weights is
shipped inside the package; weights are random-init from the shipped config with a fixed seed (see
rollout.assets.materialize_default_model). Run from the repo root:

    .venv/bin/python scripts/make_assets.py

The output is deterministic: running it twice gives byte-identical files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS = Path(__file__).resolve().parent.parent / "rollout" / "assets"
SEED = 1234
NUM_PROBLEMS = 400
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
# A one-line chat template: role markers, <|eos|> ends every turn (so it is also the stop token).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
COMMON_WORDS = """
the be to of and a in that have I it for not on with he as you do at this but his by from they we say
her she or an will my one all would there their what so up out if about who get which go me when make
can like time no just him know take people into year your good some could them see other than then now
look only come its over think also back after use two how our work first well way even new want because
any these give day most us is are was were been has had did does said made number answer result sum
difference product total equals plus minus times divided by compute calculate what's let's step think
first next finally therefore so the answer is question problem solve solution add subtract multiply
divide value find how many much more less left each every apples books coins pens cards marbles friends
has have gives takes buys sells eats keeps shares bag box basket table school teacher student class
number numbers digit digits zero one two three four five six seven eight nine ten eleven twelve hundred
thousand half double triple again start end yes no true false correct wrong check write show because
since then if else while after before now here there where why who which when what how very much many
few some all none both either neither other another same different big small large little long short
""".split()


def make_problems(rng: random.Random) -> list[dict[str, str]]:
    """Small-integer arithmetic with one exact integer answer, in a few phrasings."""
    phrasings = [
        "What is {a} {op} {b}?",
        "Compute {a} {op} {b}.",
        "Calculate {a} {op} {b}.",
        "{a} {op} {b} = ?",
    ]
    rows = []
    for _ in range(NUM_PROBLEMS):
        op = rng.choice("+-*")
        hi = 12 if op == "*" else 99
        a, b = rng.randint(2 if op == "*" else 0, hi), rng.randint(2 if op == "*" else 0, hi)
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({"prompt": rng.choice(phrasings).format(a=a, op=op, b=b), "answer": str(answer)})
    return rows


def make_tokenizer(texts: list[str]) -> Tokenizer:
    """Byte-level BPE with one token per digit: every string round-trips, arithmetic is digit-wise."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
    }


def model_config(tok: Tokenizer) -> dict[str, object]:
    """A tiny Llama: fast enough on 2 CPU cores, real architecture so the engine's Llama path runs."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tok.get_vocab_size(),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": tok.token_to_id("<|bos|>"),
        "eos_token_id": tok.token_to_id("<|eos|>"),
        "pad_token_id": tok.token_to_id("<|pad|>"),
        "torch_dtype": "float32",
    }


def write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def main() -> None:
    rng = random.Random(SEED)
    problems = make_problems(rng)
    texts = [p["prompt"] + " " + p["answer"] for p in problems]
    texts += [" ".join(COMMON_WORDS[i : i + 12]) for i in range(0, len(COMMON_WORDS), 12)]
    texts += [" " + w for w in COMMON_WORDS] + ["0 1 2 3 4 5 6 7 8 9 + - * / = ( ) . , ? !"]
    tok = make_tokenizer(texts)
    ASSETS.mkdir(parents=True, exist_ok=True)
    with (ASSETS / "arithmetic.jsonl").open("w") as f:
        for row in problems:
            f.write(json.dumps(row) + "\n")
    tok.save(str(ASSETS / "tokenizer.json"))
    write_json(ASSETS / "tokenizer_config.json", tokenizer_config())
    write_json(
        ASSETS / "special_tokens_map.json",
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"},
    )
    cfg = model_config(tok)
    write_json(ASSETS / "config.json", cfg)
    write_json(
        ASSETS / "generation_config.json",
        {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )
    total = sum(p.stat().st_size for p in ASSETS.iterdir() if p.is_file())
    print(f"wrote {ASSETS} ({total / 1024:.0f} KiB, vocab {tok.get_vocab_size()}, {len(problems)} problems)")


if __name__ == "__main__":
    main()
