"""Training prompts: generated from templates and topics, never taken from the benchmark.

Spec-Bench measures the drafter, so none of its questions may be trained on.
The prompts here are built from our own task templates (the kinds of requests
a chat model serves: writing, explaining, reasoning, coding, translating,
summarising, answering) crossed with a topic list, shuffled with a fixed seed;
``training_prompts`` drops any prompt that happens to equal a benchmark
question.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

TEMPLATES = (
    "Write a short story about {topic}.",
    "Write a poem about {topic}.",
    "Write a persuasive paragraph about why {topic} matters.",
    "Write a blog post introduction about {topic}.",
    "Explain {topic} to a ten-year-old.",
    "Explain {topic} in simple terms.",
    "What are the main advantages and disadvantages of {topic}?",
    "Give me five interesting facts about {topic}.",
    "List three common misconceptions about {topic} and correct them.",
    "Summarize what people should know about {topic} in three sentences.",
    "Describe the history of {topic} briefly.",
    "How does {topic} affect everyday life?",
    "Pretend you are a tour guide and talk about {topic}.",
    "Imagine you are a teacher. Prepare a short lesson plan about {topic}.",
    "Write an email to a friend recommending they learn about {topic}.",
    "What questions would a journalist ask an expert on {topic}?",
    "Compare {topic} with something similar and explain the differences.",
    "Write a Python function related to {topic} and explain it.",
    "Translate this sentence into French: 'I would like to learn more about {topic}.'",
    "Translate this sentence into Spanish: 'My favourite subject is {topic}.'",
    "Give step-by-step advice for a beginner interested in {topic}.",
    "What is a common problem related to {topic} and how can it be solved?",
    "Write a dialogue between two people discussing {topic}.",
    "Create a short quiz with answers about {topic}.",
    "Write a product description for a book about {topic}.",
)

TOPICS = (
    "the ocean",
    "volcanoes",
    "honey bees",
    "the moon landing",
    "photosynthesis",
    "renewable energy",
    "the printing press",
    "black holes",
    "climate change",
    "the human heart",
    "chess",
    "jazz music",
    "the Roman Empire",
    "ancient Egypt",
    "machine learning",
    "electric cars",
    "recycling",
    "rainforests",
    "the water cycle",
    "earthquakes",
    "vaccines",
    "the internet",
    "bread baking",
    "gardening",
    "sleep",
    "meditation",
    "the stock market",
    "saving money",
    "public libraries",
    "mountain climbing",
    "bicycles",
    "trains",
    "airplanes",
    "the Olympic Games",
    "football",
    "painting",
    "photography",
    "smartphones",
    "social media",
    "video games",
    "dinosaurs",
    "whales",
    "penguins",
    "cats",
    "dogs",
    "coffee",
    "tea",
    "chocolate",
    "the solar system",
    "Mars",
    "the periodic table",
    "gravity",
    "magnets",
    "electricity",
    "the immune system",
    "healthy eating",
    "running",
    "yoga",
    "time management",
    "public speaking",
    "learning a new language",
    "the French Revolution",
    "the Renaissance",
    "Shakespeare",
    "poetry",
    "democracy",
    "taxes",
    "cities",
    "farming",
    "bridges",
    "skyscrapers",
    "robots",
    "3D printing",
    "cryptography",
    "prime numbers",
    "fractions",
    "probability",
    "the Pythagorean theorem",
    "algebra",
    "sorting algorithms",
    "databases",
    "operating systems",
    "open source software",
    "the weather",
    "hurricanes",
    "deserts",
    "glaciers",
    "rivers",
    "coral reefs",
    "birds",
    "butterflies",
    "mushrooms",
    "trees",
    "museums",
    "theatre",
    "film making",
    "comic books",
    "friendship",
    "kindness",
    "teamwork",
    "job interviews",
    "starting a small business",
    "customer service",
    "online privacy",
    "passwords",
    "space telescopes",
    "the Great Wall of China",
    "pyramids",
    "the Silk Road",
    "maps",
    "compasses",
    "clocks",
    "calendars",
    "music festivals",
    "camping",
    "fishing",
    "cooking pasta",
    "spices",
    "volunteering",
    "elections",
    "newspapers",
    "radio",
    "television",
    "batteries",
    "solar panels",
)


def all_prompts(seed: int = 0) -> list[str]:
    """Every template crossed with every topic, in a fixed shuffled order."""
    prompts = [template.format(topic=topic) for template in TEMPLATES for topic in TOPICS]
    random.Random(seed).shuffle(prompts)
    return prompts


def normalise(text: str) -> str:
    """A prompt up to case and spacing: two prompts with one normal form are one prompt."""
    return " ".join(text.lower().split())


def training_prompts(count: int, excluded: Iterable[str], seed: int = 0, allow_fewer: bool = False) -> list[str]:
    """The first ``count`` generated prompts that are not among ``excluded`` (the benchmark's questions)."""
    banned = {normalise(text) for text in excluded}
    prompts = [p for p in all_prompts(seed) if normalise(p) not in banned]
    if count > len(prompts) and not allow_fewer:
        raise ValueError(f"only {len(prompts)} training prompts can be generated, {count} were asked for")
    return prompts[:count]
