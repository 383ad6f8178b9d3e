#!/usr/bin/env python3
"""A byte-level BPE tokenizer.json trained on local text with the tokenizers library (no download).

    tools/reference/train_tokenizer.py --vocab 2048 --out tokenizer.json docs/*.md README.md

For trying composer on real text without a Hugging Face model: the tests train one on the project's
own docs. Its special token <|endoftext|> is what tools/prepare-data puts between documents.
"""
import argparse

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--out", required=True)
    ap.add_argument("files", nargs="+")
    a = ap.parse_args()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=a.vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(a.files, trainer)
    tok.save(a.out)
    print(f"{a.out}: {tok.get_vocab_size()} entries from {len(a.files)} files")


if __name__ == "__main__":
    main()
