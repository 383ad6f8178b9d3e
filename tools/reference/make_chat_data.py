#!/usr/bin/env python3
"""Writes the chat data set of the masked fine-tuning experiments (configs/parity/sft_*.yaml):

    configs/data/chat/chats.jsonl   60 short conversations (system, user and assistant turns; some
                                    multi-turn, some in the prompt/completion form), drawn from seed 0
    configs/data/chat/model/        a chat model's tokenizer folder: a byte-level BPE tokenizer.json
                                    (320 entries, trained on those conversations with the tokenizers
                                    library) with ChatML's special tokens, and tokenizer_config.json
                                    whose chat_template is ChatML (<|im_start|>role ... <|im_end|>),
                                    its assistant turns marked for transformers' assistant masks

Then `tools/prepare-data --chat configs/data/chat/model --out configs/data/chat.u16
configs/data/chat/chats.jsonl` makes the token file, its index and its loss mask
(tests/cli/chat_data.py checks that it reproduces them).
"""
import json
import os
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "configs", "data", "chat")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' + '\\n' }}"
          "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
NAMES = ["two", "three", "four", "five", "six", "seven", "eight", "nine"]


def conversation(rng):
    a, b = rng.randrange(2, 10), rng.randrange(2, 10)
    q = f"What is {NAMES[a - 2]} plus {NAMES[b - 2]}?"
    ans = f"{NAMES[a - 2].capitalize()} plus {NAMES[b - 2]} is {a + b}."
    kind = rng.randrange(4)
    if kind == 0:
        return {"prompt": q, "completion": ans}
    msgs = []
    if kind >= 2:
        msgs.append({"role": "system", "content": rng.choice(["You add numbers.", "Answer briefly."])})
    msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]
    if kind == 3:
        msgs += [{"role": "user", "content": "And times two?"},
                 {"role": "assistant", "content": f"That is {2 * (a + b)}."}]
    return {"messages": msgs}


def main():
    rng = random.Random(0)
    os.makedirs(os.path.join(OUT, "model"), exist_ok=True)
    chats = [conversation(rng) for _ in range(60)]
    path = os.path.join(OUT, "chats.jsonl")
    with open(path, "w") as f:
        for c in chats:
            f.write(json.dumps(c) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([path], trainer)
    tok.save(os.path.join(OUT, "model", "tokenizer.json"))
    with open(os.path.join(OUT, "model", "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                   "pad_token": "<|endoftext|>", "chat_template": CHATML}, f, indent=1)
        f.write("\n")
    print(f"{path}: {len(chats)} conversations; {OUT}/model: {tok.get_vocab_size()} entries")


if __name__ == "__main__":
    main()
