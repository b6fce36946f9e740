"""Real English prompts for the trained test model: prose written for kvtier's tests (no third-party text), cut
into token windows of any length.

Engine tests need prompts of an exact token count (whole 32-token blocks) that are distinct from their first block
on (two prompts that share a first block share a cached prefix, and the tests count what each tier served). A
window of :data:`TEXT`'s token ids starting at a different offset is both: ``prompt_ids(ids, n, seed)`` starts at
offset ``seed * STRIDE`` (mod the corpus length; the corpus is read as a ring, so any length fits), so distinct
seeds below ``len(ids)`` never share a first block. The model continues real text, so its greedy answers are real.

Token ids come from the model's own tokenizer (``tokenizer.json`` of the converted directory): in-process with the
``tokenizers`` package where it is installed (the engine env), else by running this module with the engine env's
python (``python -m vllm_cpu.prose MODEL_DIR`` prints them as JSON), which is what the project env does.
"""
from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Sequence

STRIDE = 97  # prime, and no divisor of the corpus length (1,703 tokens): seed -> offset is one-to-one

TEXT = """\
The lighthouse on the northern point was built of grey stone that the sea had been trying to take back for a
hundred and forty years. Its keeper, a patient woman named Ilse Marrow, climbed the spiral stairs every evening at
dusk, counting the steps out loud because her father had done the same. There were one hundred and twelve of them.
At the top she trimmed the wick, polished the great lens with a soft cloth, and wrote the weather into a book whose
pages had gone the colour of weak tea.

Nobody had asked her to keep the book. The lamp had been automatic for years, and a man from the harbour office came
twice a season to check the batteries and drink her coffee. But the book had been kept since the first keeper, and
Ilse could not bring herself to be the one who stopped. So every night she wrote down the wind, the height of the
swell, the ships she could see, and anything else that seemed worth remembering: a seal asleep on the landing
stage, a comet low in the west, the night the fog came in so thick that the beam seemed to end an arm's length from
the glass.

In the village below, people set their clocks by the light. When it came on, children were called in from the
beach; when it went out at dawn, the bakery opened its shutters and the first boats slid out past the breakwater.
The baker, a broad man with flour in his eyebrows, liked to say that he had never once seen the lamp fail. This was
not quite true. In the winter of the great storm the power had gone for six hours, and Ilse had climbed the stairs
with a paraffin lantern and stood beside the dead lens all night, turning the lantern slowly by hand, so that any
ship out there would see something that looked, if it squinted, like a lighthouse doing its job.

Bread, the baker would tell anyone who stood still long enough, is mostly patience. Flour, water, salt and a little
yeast will become a loaf on their own if you give them time and a warm room. The dough rises because the yeast eats
the sugars in the flour and breathes out gas, and the gluten, stretched by kneading, holds that gas in thousands of
small pockets. Rush it and the crumb is tight and sour; leave it too long and the structure collapses under its own
weight. The whole art, he said, is in knowing when to stop waiting. Then he would sell you a loaf and a story about
his grandmother, who baked in a wood oven and judged its heat by how long she could hold her hand inside.

A river begins as rain that the ground cannot hold. It gathers in hollows, runs over stones, finds the lowest way
down and keeps to it, cutting a little deeper every year. Over thousands of years a river carves a valley, carries
mountains grain by grain to the sea, and builds wide flat plains at its mouth where the water slows and drops what
it carried. Towns grew up along rivers because rivers brought water, food, trade and a road that needed no
building. Many of the oldest cities in the world stand where a river could be crossed or where two rivers met.

The market in the old town opened at six on Saturdays. By seven the square was full: stalls of early apples and
late plums, cheeses wrapped in cloth, honey in jars with handwritten labels, cut flowers in buckets, and a man who
sharpened knives on a wheel he worked with his foot. Prices were written in chalk and argued over in good humour.
A girl sold eggs from a basket and counted change with great seriousness, checking every coin twice. At noon the
church bell rang, the stall holders began to pack away, and the pigeons came down to clear up whatever was left.

Learning to ride a bicycle is mostly a matter of trusting that speed will keep you upright. A bicycle standing
still falls over at once, but a moving one steers itself back under its rider: when it leans, the front wheel turns
into the lean and the frame comes back up. Children who are afraid to go fast wobble and fall; children who push off
hard find that the machine almost balances itself. Most people remember the moment they realised that the hand
holding the saddle had let go some time ago.

Winter came early that year. The first frost whitened the fields in the middle of October, and by November the
pond behind the school had a skin of ice thin enough to crack under a thrown pebble. The older people said it would
be a hard one and began stacking wood against the walls of their houses. The children hoped for snow and checked
the sky every morning. When it finally came, it fell all night without a sound, and in the morning the whole
valley was quiet and white, the roads gone, the hedges rounded, the church roof a smooth slope of light.

A good map is a careful set of choices about what to leave out. Every road, river and building cannot be shown, so
the mapmaker decides what the reader will need: a walker wants paths, contour lines and the places where water can
be found; a driver wants junctions, road numbers and the distance between towns. The scale sets the limits. On a
map of a whole country a city is a dot; on a map of the city the same dot becomes streets, parks, a railway station
and the bend of a river. Reading a map well means knowing what its maker chose to forget.

Tea was brought to Europe by merchants in the seventeenth century, and for a long time it was a luxury kept in
locked wooden boxes. Today it is the most widely drunk beverage in the world after water. The leaves of a single
plant make every kind of tea: green tea is dried quickly so that the leaves stay close to how they were picked,
black tea is left to darken in the air before it is dried, and the many teas between the two are stopped at
different points along the way. The water matters as much as the leaf. Too hot and green tea turns bitter; too
cool and black tea tastes thin.

The old clockmaker kept his shop open long after anyone brought him clocks to mend. He said that a clock is a small
argument against disorder: a spring that wants to unwind all at once is made to give up its energy one tick at a
time, through a wheel that can only turn a tooth at a time, checked by an escapement that lets it go and catches
it again, over and over, many thousands of times an hour. When he opened the back of a clock for a customer, he
would point to the balance wheel swinging back and forth and say that this was the heart of it, the part that
decided what a second was.

On clear nights the students climbed to the roof of the science building with a small telescope and a flask of
soup. The moon was the first thing everyone wanted to see, and it never disappointed: craters with sharp shadows
along the line between day and night, mountains catching the light before the plains around them. Jupiter came
next, a small bright disc with four points of light beside it in a line, the same moons that Galileo drew four
hundred years ago. The students wrote down their positions and came back the next night to see how they had moved.

Most of what a city needs happens where nobody looks. Water arrives under pressure in pipes laid a century ago and
leaves through sewers that were once the wonder of their age. Electricity comes in on cables from power stations
far away, and the trains run because someone at a desk in the middle of the night decided which signals would turn
green. When all of it works, no one notices, and the people who keep it working are praised only when something
goes wrong and they put it right before breakfast.

Ilse still keeps the book. On the last page she filled, she wrote that the wind was light from the south west,
that the sea was calm, that three fishing boats had gone out before dawn and all three had come back, and that the
baker had sent up a loaf still warm from the oven, which she had eaten at the top of the tower with butter and a
pot of strong tea, watching the light go round.
"""
# The paragraphs above joined into lines (their line breaks are only the source's width), a blank line after each:
# what is tokenized.
CORPUS = "".join(" ".join(par.split()) + "\n\n" for par in TEXT.split("\n\n"))


def _tokenize(model_dir: str | os.PathLike[str]) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(pathlib.Path(model_dir) / "tokenizer.json"))
    return list(tok.encode(CORPUS, add_special_tokens=False).ids)


@functools.lru_cache(maxsize=4)
def _corpus_ids(model_dir: str, python: str | None) -> tuple[int, ...]:
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        if python is None:
            raise RuntimeError("tokenizing the prompts needs the tokenizers package or the engine env's python "
                               "(pass python=, e.g. .venv-vllm-cpu/bin/python)") from None
        out = subprocess.run([python, "-I", "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                              "from vllm_cpu import prose; prose.main(sys.argv[2:])",
                              str(pathlib.Path(__file__).resolve().parents[1]), model_dir],
                             capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            raise RuntimeError(f"tokenizing with {python} failed:\n{out.stderr[-2000:]}") from None
        return tuple(json.loads(out.stdout))
    return tuple(_tokenize(model_dir))


def corpus_ids(model_dir: str | os.PathLike[str], python: str | None = None) -> list[int]:
    """:data:`CORPUS` as the model's token ids (cached per process)."""
    return list(_corpus_ids(str(model_dir), python))


def prompt_ids(ids: Sequence[int], n_tokens: int, seed: int) -> list[int]:
    """``n_tokens`` ids of the corpus ``ids`` read as a ring from offset ``seed * STRIDE``: the same for the same
    seed, and from its first token on different from any other seed's below ``len(ids)``."""
    if n_tokens < 0:
        raise ValueError(f"n_tokens: {n_tokens} must be >= 0")
    if not 0 <= seed < len(ids):
        raise ValueError(f"seed: {seed} must be in [0, {len(ids)}) for distinct windows")
    start = seed * STRIDE % len(ids)
    return [ids[(start + i) % len(ids)] for i in range(n_tokens)]


def block(ids: Sequence[int], block_id: int, n_tokens: int = 32) -> list[int]:
    """A fixed block of ``n_tokens`` for a trace's block id (Mooncake hash ids): two half-windows picked by the
    id's digits in base ``len(ids)``, so distinct ids below ``len(ids) ** 2`` (2.9 million) get distinct blocks.
    Ids that share a prefix then share tokens, and only they do, as in the trace."""
    if not 0 <= block_id < len(ids) ** 2:
        raise ValueError(f"block_id: {block_id} must be in [0, {len(ids) ** 2})")
    hi, lo = divmod(block_id, len(ids))
    half = n_tokens // 2
    return prompt_ids(ids, half, lo) + prompt_ids(ids, n_tokens - half, hi)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m vllm_cpu.prose MODEL_DIR``: the corpus's token ids as JSON."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m vllm_cpu.prose MODEL_DIR", file=sys.stderr)
        return 2
    print(json.dumps(_tokenize(args[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
