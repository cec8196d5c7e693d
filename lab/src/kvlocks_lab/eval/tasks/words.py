"""Built-in vocabularies for needle keys, extraction tasks and planted facts (no downloads).

Every list is a tuple of distinct lowercase (or, for names, capitalised) single words, so
seeded draws from them are reproducible everywhere.
"""

from __future__ import annotations

import random

NOUNS = tuple("""
apple anchor badge basket beacon bell blanket boat bottle bridge brush bucket button cabin
cable camera candle canyon carpet castle cellar chair chimney circle cliff clock cloud coast
compass cottage couch crown crystal curtain cushion desert diamond dragon drawer dream engine
falcon feather fence field finger flag flame flower forest fountain garden garlic gate glove
granite guitar hammer harbor helmet hill horizon island jacket jungle kettle kitchen ladder
lantern leaf lemon library lizard machine magnet marble meadow mirror monkey mountain needle
notebook ocean orchard otter oven paddle palace parrot pebble pencil pepper piano pillow planet
pocket pond puzzle quarry rabbit radio rainbow ribbon river rocket saddle sailor scarf shadow
shelf shield signal silver spider spoon stable statue stone storm sugar summit sunset swamp
table teapot temple thunder ticket tiger timber tower tractor trumpet tunnel turtle umbrella
valley velvet village violin wagon walnut window wizard wolf zebra anvil arrow barrel beetle
blossom canvas cedar cobweb comet copper dolphin elbow emerald ferry galaxy glacier goblet
hazel hedge iceberg jasmine kernel lagoon lobster maple meteor mitten nectar oyster pantry
pumpkin plume prism quill raven reef rudder sapphire shovel sparrow spindle tablet thistle
tulip vessel walrus whistle willow yacht
""".split())

ADJECTIVES = tuple("""
ancient bitter bold brave bright brisk calm careful cheerful clever cold crooked curious
damp dark distant dusty eager early elegant empty fancy fast fierce fluffy foggy fragile
frozen gentle giant glossy golden graceful green happy heavy hidden hollow humble icy jolly
kind lazy little lively lonely loud lucky massive mellow mighty misty modest narrow noble
odd orange patient plain polite proud purple quick quiet rapid rare restless rough round
rusty salty scarlet secret shiny silent simple sleepy slow smooth soft solid sour spicy
steady sticky stormy strange strong sunny swift tall tame tender thin tidy tiny twisted
vast vivid warm wary weary wide wild windy wise witty wooden young zealous
""".split())

FIRST_NAMES = tuple("""
Adela Bertram Cosima Dorian Edwina Fabian Greta Horace Ingrid Jasper Katrin Leopold Mirela
Nestor Ottilie Percival Quentin Rosalind Silas Theodora Ulric Valeska Wendel Xenia Yorick
Zelda Anselm Brigitta Casimir Delphine
""".split())

MONTHS = ("January", "February", "March", "April", "June", "July", "August", "September",
          "October", "November", "December")  # no "May": it is also a common English verb

COLOURS = ("crimson", "turquoise", "scarlet", "amber", "violet", "indigo", "ochre", "emerald",
           "maroon", "ivory", "lavender", "charcoal")

MATERIALS = ("granite", "limestone", "sandstone", "marble", "basalt", "brick", "slate",
             "timber", "bronze", "cedar", "flint", "terracotta")

_TOWN_HEADS = ("Bar", "Cal", "Dun", "Fen", "Hal", "Kel", "Mor", "Ost", "Pel", "Ros", "Tam", "Vel",
               "Wex", "Yar", "Brig", "Corr", "Elm", "Grim", "Lun", "Thorn")
_TOWN_TAILS = ("bury", "dale", "ford", "holm", "mere", "stead", "wick", "ton", "moor", "brook",
               "haven", "gate")
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def distinct(rng: random.Random, make, count: int, avoid: set[str] | None = None) -> list[str]:
    """``count`` distinct values of ``make(rng)``, none of them in ``avoid``."""
    seen = set(avoid or ())
    out: list[str] = []
    while len(out) < count:
        value = make(rng)
        if value not in seen:
            seen.add(value)
            out.append(value)
    return out


def key_phrase(rng: random.Random) -> str:
    """A needle key such as ``"quiet-harbor"`` (adjective-noun)."""
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def number(rng: random.Random, digits: int = 7) -> str:
    """A ``digits``-digit decimal number without a leading zero, as a string."""
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def town(rng: random.Random) -> str:
    """An invented town name such as ``"Fenholm"``."""
    return rng.choice(_TOWN_HEADS) + rng.choice(_TOWN_TAILS)


def pseudo_word(rng: random.Random) -> str:
    """A pronounceable five-letter non-word (consonant-vowel pattern CVCVC)."""
    pick = (_CONSONANTS, _VOWELS, _CONSONANTS, _VOWELS, _CONSONANTS)
    return "".join(rng.choice(letters) for letters in pick)


def var_name(rng: random.Random) -> str:
    """A five-letter upper-case variable name such as ``"QXBRT"``."""
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
