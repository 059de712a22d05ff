"""Character-level tokenizer for tiny from-scratch models.

One token per character, so a 2-digit sum like ``15-43=`` is 6 tokens and the model never has to
learn a BPE segmentation of numbers. Built from the ``tokenizers`` library (WordLevel model) and
wrapped as a ``transformers`` fast tokenizer, so ``save_pretrained`` output loads with
``AutoTokenizer.from_pretrained`` and in vLLM.

Vocabulary (ids are fixed, the train loop and tests rely on them)::

    0 <pad>   1 <bos>   2 <eos>   3 <unk>   4.. the alphabet's characters, sorted

Special-token policy: encoding does NOT add ``<bos>``/``<eos>`` automatically (no post-processor).
The caller prepends ``<bos>`` to prompts and appends ``<eos>`` to SFT targets. Special tokens may
also be written inline as text (``"<bos>15-43="`` encodes to ``[1, ...]``): they are matched before
the per-character split.

Decoding concatenates tokens with no separator (``decoders.Fuse``), so
``decode(encode(s)) == s`` for any ``s`` made of alphabet characters (spaces, newlines, digits and
'-' included). ``clean_up_tokenization_spaces`` is off: transformers' clean-up would otherwise turn
``"1 ."`` into ``"1."``. Characters outside the alphabet map to ``<unk>`` and do not round-trip.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)


def build_char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer over ``alphabet`` (duplicates ignored, order irrelevant).

    Returns a ``PreTrainedTokenizerFast`` (in transformers 5 its class is ``TokenizersBackend``)
    with ``pad_token_id=0, bos_token_id=1, eos_token_id=2, unk_token_id=3``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = sorted(set(alphabet))
    if not chars:
        raise ValueError("alphabet is empty; build the tokenizer from Task.alphabet()")
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # [\s\S] matches every character including "\n" ("." would skip newlines); "isolated" keeps
    # each match as its own piece, so whitespace is a token, not a separator.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse concatenates the token strings: no spaces inserted between characters. vLLM's
    # incremental detokenizer goes through this same decoder.
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )
