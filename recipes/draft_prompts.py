"""Prompts for distilling the embedded draft, built from text every machine has.

Three domains, each a deterministic function of a seed:
- code: Python standard-library functions and classes (their names and the first
  line of their docstrings) turned into "write a function that ..." asks;
- math: templated arithmetic and algebra word problems with random numbers;
- chat: general questions from templated topics.

The target answers these itself (on-policy self-distillation, DistillSpec,
Zhou et al. 2023), so the draft learns the target's own output distribution.
"""

from __future__ import annotations

import importlib
import inspect
import random

STDLIB_MODULES = (
    "string textwrap itertools functools collections json re math statistics heapq bisect random "
    "shutil os.path urllib.parse base64 hashlib difflib fnmatch glob csv html calendar operator copy "
    "secrets zlib fractions decimal datetime ipaddress shlex uuid pprint keyword unicodedata colorsys "
    "struct binascii email.utils filecmp tempfile zipfile gzip tarfile mimetypes locale platform ast "
    "contextlib enum dataclasses queue sched threading subprocess socket logging argparse "
    "configparser pickle sqlite3 xml.etree.ElementTree plistlib "
    # added for the GPU distillation run (recipes/gpu_distill.sh): more asks to answer
    "array bz2 cmath codecs dis doctest getopt gettext graphlib hmac http.client http.cookies io "
    "inspect linecache lzma numbers optparse pathlib pkgutil reprlib selectors shelve signal stat "
    "sysconfig timeit tokenize traceback types typing warnings weakref urllib.request "
    "email.message xml.dom.minidom asyncio concurrent.futures unittest pstats code pdb "
    "html.parser wave zipimport ftplib smtplib").split()

CODE_TEMPLATES = (
    "Write a Python function that does the following: {doc}",
    "Implement a simplified version of Python's `{qual}` from scratch. Its documentation says: \"{doc}\"",
    "Explain what `{qual}` does in Python and show a short example.",
    "How do I use `{qual}`? {doc}",
    "Write a Python function `{name}` with type hints and a docstring. It should: {doc}",
)
CODE_TASKS = (
    "reverses the words in a sentence", "checks whether a string is a palindrome",
    "counts the vowels in a string", "returns the n-th Fibonacci number", "flattens a nested list",
    "removes duplicates from a list while keeping order", "merges two sorted lists",
    "finds the largest element in a list", "computes the factorial of a number",
    "checks whether a number is prime", "reads a CSV file and returns the rows as dictionaries",
    "counts word frequencies in a text", "converts Celsius to Fahrenheit", "sorts a list of tuples by the second element",
    "finds the common elements of two lists", "validates an email address with a regular expression",
    "returns the binary representation of an integer", "implements binary search",
    "groups a list of words by their first letter", "computes the average of a list of numbers",
    "transposes a matrix", "capitalizes the first letter of every word", "implements a stack class",
    "parses a date string and returns the day of the week", "chunks a list into pieces of size n",
    "computes the greatest common divisor of two numbers", "rotates a list by k positions",
    "checks whether two strings are anagrams", "returns all permutations of a string",
    "finds the second largest number in a list", "counts the lines in a text file",
    "converts a Roman numeral to an integer", "implements a queue with two stacks",
    "computes the sum of the digits of a number", "finds the longest common prefix of a list of strings",
    "checks whether brackets in a string are balanced", "returns the prime factors of a number",
    "implements bubble sort", "implements quicksort", "implements merge sort",
    "finds the missing number in a list from 1 to n", "reverses a linked list",
    "computes the dot product of two vectors", "multiplies two matrices",
    "returns the n-th row of Pascal's triangle", "converts a string to title case without built-ins",
    "finds the most common element in a list", "checks whether a year is a leap year",
    "computes compound interest", "generates a random password of a given length",
    "removes all whitespace from a string", "splits a camelCase string into words",
    "finds all pairs in a list that sum to a target", "computes the running average of a stream of numbers",
    "implements a least-recently-used cache", "parses a query string into a dictionary",
    "computes the Levenshtein distance between two strings", "checks whether a graph has a cycle",
    "does a breadth-first search on a graph", "counts the islands in a grid of 0s and 1s",
    "returns the intersection of two dictionaries", "converts a list of pairs into a dictionary",
    "formats a number with thousands separators", "truncates a string to n characters with an ellipsis",
)
CODE_LANGS = ("Python", "Python", "Python", "JavaScript", "C", "Rust", "Go", "Java")

MATH_ITEMS = ("apples", "pencils", "books", "tickets", "oranges", "notebooks", "cookies", "marbles")
NAMES = ("Tom", "Maria", "Aisha", "Ken", "Lucy", "Omar", "Sofia", "Ben", "Priya", "Jonas")

CHAT_TOPICS = (
    "photosynthesis", "black holes", "the French Revolution", "machine learning", "climate change",
    "the immune system", "inflation", "the Roman Empire", "volcanoes", "the internet", "vaccines",
    "renewable energy", "the water cycle", "democracy", "plate tectonics", "the stock market",
    "quantum computing", "the human brain", "coffee", "the Olympic Games", "jazz music", "honeybees",
    "the Moon landing", "electric cars", "sleep", "meditation", "the printing press", "rainforests",
    "cryptography", "the Great Wall of China", "DNA", "gravity", "social media", "recycling",
    "the Renaissance", "earthquakes", "antibiotics", "solar panels", "chess", "the Silk Road",
    "the Industrial Revolution", "tides", "the speed of light", "evolution", "the ancient Egyptians",
    "hurricanes", "nutrition", "the heart", "electricity", "magnets", "rain", "rainbows", "the seasons",
    "supply and demand", "the United Nations", "the periodic table", "bacteria", "viruses", "coral reefs",
    "the Amazon river", "mountains", "deserts", "the solar system", "Mars", "satellites", "airplanes",
    "bridges", "the telephone", "photography", "cinema", "classical music", "the Beatles", "football",
    "basketball", "yoga", "tea", "chocolate", "bread", "pizza", "dinosaurs", "whales", "penguins",
    "cats", "dogs", "trees", "the ocean", "glaciers", "the Vikings", "the Cold War", "the Internet of Things",
    "blockchain", "robots", "3D printing", "nuclear energy", "wind power", "batteries", "memory",
)
CHAT_TEMPLATES = (
    "Explain {t} in simple terms.", "What is {t}?", "Give me three interesting facts about {t}.",
    "Why is {t} important?", "Write a short paragraph about {t} for a ten-year-old.",
    "What are the main advantages and disadvantages of {t}?", "Summarize the history of {t}.",
    "Write a short poem about {t}.", "What should a beginner know about {t}?",
    "What is the difference between {t} and {u}?", "How are {t} and {u} related?",
    "Tell me a fun fact about {t}.", "Explain {t} in two sentences.", "How does {t} work?",
    "Write a short story that involves {t}.", "What would happen if there were no {t}?",
    "Give me a list of five questions to ask an expert on {t}.",
)
CHAT_ASKS = (
    "Give me five tips for {g}.", "How can I get better at {g}?", "Write a short email asking my manager about {g}.",
    "What are common mistakes people make when {g}?", "Make a one-week plan for {g}.",
)
CHAT_GOALS = (
    "learning a new language", "saving money", "running a marathon", "studying for exams",
    "cooking healthy meals", "public speaking", "sleeping better", "writing a resume",
    "starting a vegetable garden", "working from home", "learning to play the guitar",
    "taking a day off next week", "reading more books", "staying focused", "making new friends",
    "learning to code", "drinking more water", "getting up early", "managing stress", "traveling on a budget",
    "preparing for a job interview", "keeping a journal", "learning to draw", "decluttering my home",
    "training a puppy", "planning a birthday party", "negotiating a salary", "writing a novel",
)


# appended to some code and chat asks (the GPU run needs more distinct prompts than the lists give)
STYLE_SUFFIXES = ("", "", "", " Keep it short.", " Explain step by step.", " Include an example.",
                  " Use bullet points.", " Answer in one paragraph.")


def stdlib_docs() -> list[tuple[str, str, str]]:
    """(module, name, first docstring line) for public stdlib callables, in a fixed order."""
    out = []
    for module_name in STDLIB_MODULES:
        try:
            module = importlib.import_module(module_name)
        except Exception:  # a module missing on this build of Python: skip it
            continue
        for name in sorted(vars(module)):
            obj = getattr(module, name)
            if name.startswith("_") or not callable(obj):
                continue
            doc = (inspect.getdoc(obj) or "").strip().split("\n")[0].strip()
            if len(doc) >= 20 and not doc.startswith(name + "("):
                out.append((module_name, name, doc))
    return out


def code_prompts(rng: random.Random, n: int) -> list[str]:
    docs = stdlib_docs()
    out = []
    for i in range(n):
        if i % 3 == 2:
            lang = rng.choice(CODE_LANGS)
            out.append(f"Write a {lang} function that {rng.choice(CODE_TASKS)}.")
            continue
        module, name, doc = rng.choice(docs)
        ask = rng.choice(CODE_TEMPLATES).format(qual=f"{module}.{name}", name=name, doc=doc)
        suffix = rng.choice(STYLE_SUFFIXES)
        if suffix and ask[-1] not in '.?!"':
            ask += "."
        out.append(ask + suffix)
    return out


def _math_one(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 20)
    who, item = rng.choice(NAMES), rng.choice(MATH_ITEMS)
    x = rng.randint(-12, 12)
    forms = (
        f"What is {a} + {b} * {c}?",
        f"Calculate {a * c} divided by {c}, then add {b}.",
        f"Solve for x: {c}x + {a} = {c * x + a}.",
        f"{who} has {a} {item} and buys {b} more, then gives away {c}. How many {item} does {who} have now?",
        f"A shop sells {item} for ${c} each. How much do {a} {item} cost?",
        f"What is {c}% of {a * 10}?",
        f"A rectangle is {a} cm long and {c} cm wide. What are its area and perimeter?",
        f"If a train travels at {a} km/h for {c} hours, how far does it go?",
        f"Simplify the fraction {a * c}/{b * c}.",
        f"What is the square of {a}, and what is the square root of {c * c}?",
        f"Solve the system: x + y = {a + b}, x - y = {a - b}.",
        f"{who} reads {c} pages a day. How many days to finish a {a * c}-page book?",
        f"Expand (x + {c})(x - {b % 10 + 1}).",
        f"What is the average of {a}, {b} and {c}?",
    )
    return rng.choice(forms)


def math_prompts(rng: random.Random, n: int) -> list[str]:
    return [_math_one(rng) for _ in range(n)]


def chat_prompts(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        if rng.random() < 0.25:
            ask = rng.choice(CHAT_ASKS).format(g=rng.choice(CHAT_GOALS))
        else:
            t, u = rng.sample(CHAT_TOPICS, 2)
            ask = rng.choice(CHAT_TEMPLATES).format(t=t, u=u)
        out.append(ask + rng.choice(STYLE_SUFFIXES))
    return out


def build_prompts(n_per_domain: int, seed: int = 0, exclude: set[str] = frozenset()) -> list[dict]:
    """Interleaved [{"domain", "prompt", "heldout"}]; every 8th prompt of a domain is held out.

    Duplicates are dropped, so a held-out prompt never also appears in training; so is every
    prompt in `exclude` (another set's prompts, for a corpus drawn beside it).
    """
    rng = random.Random(seed)
    by_domain = {"code": code_prompts(rng, n_per_domain), "math": math_prompts(rng, n_per_domain),
                 "chat": chat_prompts(rng, n_per_domain)}
    seen, rows = set(exclude), []
    for i in range(n_per_domain):
        for domain, prompts in by_domain.items():
            if prompts[i] in seen:
                continue
            seen.add(prompts[i])
            rows.append({"domain": domain, "prompt": prompts[i], "heldout": i % 8 == 7})
    return rows
