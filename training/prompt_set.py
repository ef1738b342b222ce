"""specair's own prompt set for self-distillation: hand-written templates and topics, combined deterministically.

`python -m specair.training.prompt_set` rewrites `prompts.jsonl` next to this file; `load_prompts` reads it.
Every record is chat-style, `{"id", "messages": [{"role": "user", "content"}], "split", "category"}`.
About one prompt in ten of every category is held out (`split: "heldout"`) for the offline acceptance eval.
Nothing here is downloaded: the passages, code and sentences were written for this file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from collections.abc import Iterator

from specair.models.errors import InputError
from specair.runtime.prompts import read_prompt_file

PROMPTS_FILE = Path(__file__).with_name("prompts.jsonl")
CATEGORIES = ("chat", "explain", "code_write", "code_explain", "summarize", "translate", "math", "retrieval",
              "creative", "howto")
SPLITS = ("train", "heldout")
HELDOUT_EVERY = 10  # one prompt in 10 of each category (after the deterministic shuffle) is held out
SEED = 20240611

# ---- general chat: open questions, advice, opinions ----
CHAT = [
    "I have a job interview tomorrow and I'm nervous. Any advice?",
    "What's a good way to start learning to cook if I've never cooked before?",
    "Can you recommend a few habits that help people sleep better?",
    "My friend and I disagree about whether cats or dogs make better pets. What do you think?",
    "I want to get fit but I only have 20 minutes a day. What should I do?",
    "How do I politely say no when a coworker keeps asking me for favors?",
    "What are some fun things to do on a rainy weekend at home?",
    "I keep procrastinating on my thesis. How can I get started?",
    "Is it better to rent or buy a home? What should I consider?",
    "What should I pack for a three-day hiking trip?",
    "How can I make new friends after moving to a new city?",
    "I'm thinking about learning a musical instrument as an adult. Which one would you suggest?",
    "What are the pros and cons of working from home?",
    "How do I stay motivated when learning a new language?",
    "Can you suggest a simple weekly budget plan for a student?",
    "What is a good gift for someone who loves gardening?",
    "How do I deal with stress during exam season?",
    "What questions should I ask when adopting a dog from a shelter?",
    "My houseplants keep dying. What am I doing wrong?",
    "How do I give constructive feedback to a teammate?",
    "What are some good ways to reduce screen time?",
    "I want to read more books this year. How should I plan it?",
    "How should I prepare for my first marathon?",
    "What are some tips for taking better photos with a phone?",
    "How can I be a better listener?",
    "What's the best way to organize a small kitchen?",
    "I'm bored of my usual breakfast. Any quick ideas?",
    "How do I choose a good laptop for programming?",
    "What makes a good team leader?",
    "Can you help me plan a birthday party for a ten-year-old?",
    "How do I start journaling, and what should I write about?",
    "What are some ways to save money on groceries?",
    "I'm moving abroad for work. What should I sort out before I leave?",
    "How can I improve my public speaking?",
    "What are good conversation starters at a networking event?",
    "How do I keep a long-distance friendship going?",
    "What should I know before getting my first credit card?",
    "How do I make my small apartment feel bigger?",
    "Any tips for traveling on a tight budget?",
    "How can I learn to wake up earlier?",
    "What's a healthy way to handle criticism at work?",
    "I want to volunteer in my community. Where do I start?",
    "What are some easy ways to be more environmentally friendly at home?",
    "How do I write a good thank-you note?",
    "What should I do if I feel lonely?",
    "How can parents encourage kids to read more?",
    "How do I decide between two job offers?",
    "What are some relaxing hobbies I could pick up?",
    "How do I stop overthinking small decisions?",
    "What's the best way to learn touch typing?",
    "Can you give me ideas for a cheap but fun date night?",
    "How do I prepare for a long flight?",
    "What should I consider when choosing a university course?",
    "How can I keep my phone battery healthy?",
    "I have too many browser tabs open all the time. How do I manage information overload?",
    "How can I get better at remembering people's names?",
    "What is a sensible morning routine?",
    "How do I ask my manager for a raise?",
    "What should a beginner know about running?",
    "How can I make studying less boring?",
    "Tell me a fun fact about octopuses.",
    "What are some good board games for a family evening?",
    "How do I clean a cast iron pan?",
    "What do you think makes a city pleasant to live in?",
    "How can I be more productive in the afternoon?",
    "What's a good way to learn the basics of drawing?",
    "How do I support a friend who is going through a hard time?",
    "How should I start investing with a small amount of money?",
    "What are some good habits for keeping my email inbox under control?",
    "What should I do on my first day at a new job?",
    "How do I choose a good pair of running shoes?",
    "Why do people enjoy scary movies?",
    "How can I make my presentations more engaging?",
    "What are some tips for a successful video call?",
    "How do I get back into exercise after a long break?",
    "What's the best way to memorize vocabulary?",
    "How can I reduce food waste at home?",
    "How can I make a room quieter?",
    "Give me some ideas for a short weekend trip near the mountains.",
    "How should I care for a new puppy during the first week?",
    "What are signs that I need a break from work?",
    "How can I practice gratitude every day?",
    "What's the difference between a hobby and a passion?",
    "How can I stay focused while working in a noisy cafe?",
    "How do I plan a vegetable garden for the first time?",
    "What are good questions to ask at the end of a job interview?",
    "How can I keep my kids entertained on a long car ride?",
    "How do I become a morning person?",
    "How do I apologize sincerely?",
    "What makes a good book club discussion?",
]

# ---- explanations: templates x topics ----
EXPLAIN_TEMPLATES = [
    "Explain {t} in simple terms.",
    "What is {t}?",
    "Can you explain how {t} works?",
    "Explain {t} to a ten-year-old.",
    "Give me a short explanation of {t}, with an example.",
    "Why is {t} important?",
    "What are the main ideas behind {t}?",
    "I never understood {t}. Could you walk me through it?",
    "Describe {t} in three or four sentences.",
    "What are common misconceptions about {t}?",
]
EXPLAIN_TOPICS = [
    "photosynthesis", "the water cycle", "inflation", "compound interest", "how vaccines work", "black holes",
    "the greenhouse effect", "supply and demand", "how the internet works", "plate tectonics",
    "the theory of evolution", "machine learning", "blockchain", "the immune system", "electric circuits",
    "gravity", "how a refrigerator works", "the stock market", "DNA", "the French Revolution", "democracy",
    "the Pythagorean theorem", "the scientific method", "recycling", "how airplanes fly", "the seasons",
    "tides", "solar panels", "neural networks", "encryption", "the placebo effect", "opportunity cost",
    "photosynthesis versus respiration", "how batteries store energy", "the Big Bang", "continental drift",
    "how rainbows form", "the human heart", "antibiotics", "compilers", "operating systems", "cloud computing",
    "the printing press", "the Roman Empire", "climate versus weather", "the moon's phases", "volcanoes",
    "earthquakes", "how GPS works", "renewable energy", "the food chain", "probability", "statistics",
    "a budget deficit", "interest rates", "the speed of light", "magnetism", "atoms", "chemical reactions",
    "how sound travels", "the nervous system", "sleep cycles", "how memory works", "the Industrial Revolution",
    "the Silk Road", "recursion", "version control", "how search engines rank pages", "nuclear energy",
    "erosion", "ocean currents", "bees and pollination", "how cameras work", "the metric system",
]

# ---- code writing: tasks x languages ----
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "counts the words in a sentence", "finds the largest element of a list",
    "removes duplicates from a list while keeping the order", "checks whether a string is a palindrome",
    "sorts a list of numbers with bubble sort", "performs binary search on a sorted list",
    "converts Celsius to Fahrenheit", "merges two sorted lists into one sorted list",
    "counts how often each character appears in a string", "computes the greatest common divisor of two numbers",
    "flattens a nested list", "checks whether two strings are anagrams", "sums the digits of an integer",
    "finds the second largest number in a list", "capitalizes the first letter of every word",
    "reads a text file and prints the number of lines", "validates a simple email address",
    "transposes a matrix", "computes the average of a list of numbers", "converts a decimal number to binary",
    "finds all even numbers in a list", "rotates a list by k positions", "checks whether a year is a leap year",
    "generates the first n prime numbers", "returns the longest word in a sentence",
    "implements a simple stack with push and pop", "implements a queue using two stacks",
    "counts the vowels in a string", "computes the power set of a small list",
    "checks whether brackets in a string are balanced", "finds the intersection of two lists",
    "converts a Roman numeral to an integer", "computes the running sum of a list",
    "returns the minimum and maximum of a list in one pass", "splits a list into chunks of size n",
    "implements FizzBuzz up to 100",
]
CODE_LANGUAGES = ["Python", "JavaScript", "C", "Java", "Rust", "Go", "C++", "TypeScript"]
CODE_TEMPLATES = [
    "Write a {lang} function that {task}.",
    "In {lang}, how would I write a function that {task}?",
    "Write a short {lang} program that {task}, with comments.",
    "Show me {lang} code that {task}.",
]

# ---- code explanation: snippets x questions ----
CODE_SNIPPETS = [
    ("python", "def f(xs):\n    return [x * x for x in xs if x % 2 == 0]"),
    ("python", "import collections\n\ndef top(words, n):\n    return collections.Counter(words).most_common(n)"),
    ("python", "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a"),
    ("python", "with open('data.txt') as f:\n    lines = [line.strip() for line in f if line.strip()]\nprint(len(lines))"),
    ("python", ("def memo(fn):\n    cache = {}\n    def wrapper(x):\n        if x not in cache:\n"
               "            cache[x] = fn(x)\n        return cache[x]\n    return wrapper")),
    ("python", "result = sorted(people, key=lambda p: (p['age'], p['name']))"),
    ("python", ("class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def increment(self):\n"
               "        self.count += 1\n        return self.count")),
    ("python", "def is_sorted(xs):\n    return all(a <= b for a, b in zip(xs, xs[1:]))"),
    ("python", "try:\n    value = int(text)\nexcept ValueError:\n    value = 0"),
    ("python", "squares = {n: n ** 2 for n in range(1, 6)}\nprint(squares)"),
    ("javascript", "const total = items.reduce((sum, item) => sum + item.price, 0);"),
    ("javascript", ("function debounce(fn, ms) {\n  let t;\n  return (...args) => {\n    clearTimeout(t);\n"
                   "    t = setTimeout(() => fn(...args), ms);\n  };\n}")),
    ("javascript", "const names = users.filter(u => u.active).map(u => u.name);"),
    ("javascript", "async function load(url) {\n  const res = await fetch(url);\n  return res.json();\n}"),
    ("javascript", ("document.querySelector('#btn').addEventListener('click', () => {\n"
                   "  console.log('clicked');\n});")),
    ("c", "int sum(int *a, int n) {\n    int s = 0;\n    for (int i = 0; i < n; i++) s += a[i];\n    return s;\n}"),
    ("c", "void swap(int *a, int *b) {\n    int t = *a;\n    *a = *b;\n    *b = t;\n}"),
    ("c", "size_t len(const char *s) {\n    const char *p = s;\n    while (*p) p++;\n    return p - s;\n}"),
    ("sql", "SELECT department, COUNT(*) AS n\nFROM employees\nGROUP BY department\nHAVING COUNT(*) > 5;"),
    ("sql", "SELECT c.name, SUM(o.total)\nFROM customers c JOIN orders o ON o.customer_id = c.id\nGROUP BY c.name;"),
    ("bash", "for f in *.txt; do\n  wc -l \"$f\"\ndone"),
    ("bash", "find . -name '*.log' -mtime +7 -delete"),
    ("rust", "fn largest(v: &[i32]) -> Option<i32> {\n    v.iter().copied().max()\n}"),
    ("go", ("func reverse(s []int) {\n\tfor i, j := 0, len(s)-1; i < j; i, j = i+1, j-1 {\n"
           "\t\ts[i], s[j] = s[j], s[i]\n\t}\n}")),
    ("java", "public static boolean isEven(int n) {\n    return n % 2 == 0;\n}"),
]
CODE_QUESTIONS = [
    "What does this {lang} code do?\n\n```{lang}\n{code}\n```",
    "Explain this {lang} snippet line by line:\n\n```{lang}\n{code}\n```",
    "Can this {lang} code be improved? Explain what it does first.\n\n```{lang}\n{code}\n```",
    "I found this in a codebase. What is its purpose?\n\n```{lang}\n{code}\n```",
]

# ---- passages for summarisation and retrieval-style questions (written for this file) ----
PASSAGES = [
    (("The town of Millbrook built its first public library in 1902 with money raised by a group of local "
     "teachers. The building had two rooms and about four hundred books. In 1958 a larger library opened on "
     "Main Street, with a children's section and a reading room for newspapers. Today the library lends "
     "e-books as well as printed books, and it runs free computer classes for older residents every Tuesday."),
     ["When was Millbrook's first public library built?", "Who raised the money for the first library?",
      "What does the library offer older residents today?"]),
    (("Honeybees communicate the location of food through a movement called the waggle dance. A forager that "
     "has found flowers returns to the hive and walks in a figure-eight pattern. The angle of the straight part "
     "of the dance shows the direction of the food relative to the sun, and the length of the waggle shows "
     "the distance. Other bees follow the dancer and then fly out to find the flowers themselves."),
     ["What is the waggle dance used for?", "How does the dance show the direction of the food?",
      "What does the length of the waggle indicate?"]),
    (("The Riverside Community Garden has forty plots, each three meters by two meters. Members pay twenty "
     "dollars a year and must water their plot at least twice a week in summer. Tools are kept in a shared "
     "shed that is unlocked from seven in the morning until eight in the evening. Any plot left untended for "
     "six weeks is offered to the next person on the waiting list."),
     ["How much does a plot cost per year?", "What happens to a plot left untended?",
      "When is the tool shed open?"]),
    (("Maria started her bakery in a rented kitchen in 2015, selling bread at weekend markets. Her sourdough "
     "became popular, and by 2018 she had opened a small shop with three employees. During the winter of 2020 "
     "she began delivering bread by bicycle to customers within five kilometers. The shop now also sells "
     "pastries, and Maria teaches a bread-making class once a month."),
     ["Where did Maria first sell her bread?", "When did she open her shop?",
      "How did she deliver bread in 2020?"]),
    (("Glaciers form where more snow falls in winter than melts in summer. Over many years the snow is "
     "compressed into dense ice. When the ice becomes thick enough, its own weight makes it flow slowly "
     "downhill. As glaciers move they grind the rock beneath them, carving valleys with a characteristic U "
     "shape. Many lakes in northern Europe and North America were left behind by retreating glaciers."),
     ["Why does a glacier start to move?", "What shape of valley do glaciers carve?",
      "What conditions are needed for a glacier to form?"]),
    (("The company's new travel policy takes effect on the first of March. Employees must book flights at "
     "least fourteen days in advance unless a manager approves an exception. Economy class is required for "
     "flights shorter than six hours. Hotel costs are reimbursed up to 150 euros per night, and receipts must "
     "be submitted within thirty days of returning."),
     ["When does the new travel policy start?", "How far in advance must flights be booked?",
      "What is the hotel limit per night?"]),
    (("Tomatoes grow best in warm weather with at least six hours of direct sunlight per day. Seeds are "
     "usually started indoors six to eight weeks before the last spring frost. Once the seedlings are "
     "transplanted outside, they need regular deep watering, and tall varieties should be tied to stakes. "
     "Removing the small shoots that grow between the stem and branches can help the plant produce larger "
     "fruit."),
     ["How much sunlight do tomatoes need?", "When should tomato seeds be started indoors?",
      "Why remove the small shoots between stem and branches?"]),
    (("The first practical telephone was patented in 1876. Early telephones were sold in pairs, connecting "
     "two fixed locations such as a home and an office. Switchboards, introduced a few years later, let many "
     "subscribers connect to each other through an operator who plugged cables into sockets. Automatic "
     "exchanges, which used the numbers a caller dialed, gradually replaced human operators in the twentieth "
     "century."),
     ["When was the first practical telephone patented?", "How were early telephones sold?",
      "What replaced the human operators?"]),
    (("Our apartment building will have its water supply shut off on Thursday from nine in the morning until "
     "about two in the afternoon while pipes in the basement are replaced. Residents are advised to store "
     "some water beforehand. The elevator will work normally, but the laundry room will be closed for the "
     "whole day. Please contact the building manager, Mr. Okafor, with any questions."),
     ["When will the water be shut off?", "Will the laundry room be open on Thursday?",
      "Who should residents contact with questions?"]),
    (("Sea turtles return to the beaches where they hatched to lay their own eggs, sometimes decades later. "
     "A female digs a nest in the sand at night and lays around one hundred eggs. After about two months the "
     "hatchlings dig their way out and head for the sea, guided by the brighter horizon over the water. "
     "Artificial lights near beaches can confuse them and lead them inland."),
     ["How many eggs does a sea turtle lay in a nest?", "How do hatchlings find the sea?",
      "Why are artificial lights a problem for hatchlings?"]),
    (("The Greenfield marathon starts at 7:30 a.m. at the city stadium. Runners must collect their race "
     "numbers on Saturday between ten and six at the sports hall. Water stations are placed every five "
     "kilometers, and there is a time limit of six hours. Roads along the route will be closed to traffic "
     "until three in the afternoon."),
     ["Where does the marathon start?", "When can runners collect their numbers?",
      "What is the time limit for the race?"]),
    (("Coffee plants grow in tropical regions, usually at altitudes between 600 and 2000 meters. The fruit, "
     "called a cherry, contains two seeds that become coffee beans. After harvest the beans are separated from "
     "the fruit, dried, and later roasted, which develops their flavor and brown color. Lighter roasts keep "
     "more of the bean's acidity, while darker roasts taste more bitter."),
     ["At what altitudes does coffee usually grow?", "What is the coffee fruit called?",
      "How do light and dark roasts differ in taste?"]),
    (("In the study, 120 volunteers were divided into two groups. One group walked for thirty minutes every "
     "day for eight weeks, while the other kept their usual routine. At the end of the study, the walking "
     "group reported better sleep and slightly lower stress levels. The researchers noted that the study was "
     "small and that longer trials are needed to confirm the results."),
     ["How many volunteers took part in the study?", "What did the walking group report?",
      "What limitation did the researchers mention?"]),
    (("The museum is open from Tuesday to Sunday, ten in the morning to six in the evening, and until nine on "
     "Thursdays. Admission is free for children under twelve and for everyone on the first Sunday of each "
     "month. Large bags must be left in the cloakroom. Photography is allowed in the permanent collection but "
     "not in temporary exhibitions."),
     ["On which day is the museum open late?", "Who can enter for free?",
      "Where is photography not allowed?"]),
    (("Lighthouses were built to warn ships of dangerous coasts and to guide them into harbors. Each "
     "lighthouse has its own pattern of flashes, so sailors can tell which one they are seeing at night. "
     "Early lighthouses burned wood or oil, while later ones used powerful electric lamps and large glass "
     "lenses. Today most lighthouses are automated, and satellite navigation has reduced their importance."),
     ["Why does each lighthouse have its own flash pattern?", "What did early lighthouses burn?",
      "Why are lighthouses less important today?"]),
    (("The school's science fair will be held on May 14 in the gymnasium. Each project must include a poster "
     "and a short written report of no more than two pages. Students may work alone or in pairs. Judges will "
     "score projects on originality, method, and how clearly the results are explained, and the three best "
     "projects will be shown at the regional fair in June."),
     ["Where will the science fair be held?", "How long may the written report be?",
      "What happens to the three best projects?"]),
    (("Octopuses have three hearts and blue blood, which carries oxygen using a copper-based protein. They "
     "can change the color and texture of their skin in a fraction of a second to hide from predators. Most "
     "of their neurons are located in their arms, which can react to touch and taste on their own. Octopuses "
     "usually live only one or two years."),
     ["How many hearts does an octopus have?", "Why is octopus blood blue?",
      "Where are most of an octopus's neurons?"]),
    (("The new bus line 42 connects the train station with the university and the hospital. Buses run every "
     "ten minutes during rush hours and every twenty minutes in the evening. A single ticket costs two "
     "dollars, and students with a valid card ride for half price. The line does not run on public holidays "
     "during its first year."),
     ["Which places does bus line 42 connect?", "How often do buses run in the evening?",
      "How much do students pay?"]),
    (("Paper was invented in China around two thousand years ago, made from plant fibers soaked in water and "
     "pressed into thin sheets. The technique spread along trade routes to the Middle East and later to "
     "Europe. Before paper became common, people wrote on materials such as papyrus, parchment made from "
     "animal skin, and tablets of clay or wax."),
     ["Where was paper invented?", "How was early paper made?",
      "What did people write on before paper?"]),
    (("To reset your password, open the login page and click 'Forgot password'. Enter the email address "
     "linked to your account, and we will send you a link that stays valid for one hour. The new password "
     "must be at least twelve characters long and may not match any of your last three passwords. If you do "
     "not receive the email, check your spam folder."),
     ["How long is the reset link valid?", "How long must the new password be?",
      "What should you do if the email does not arrive?"]),
    (("Penguins live almost entirely in the Southern Hemisphere. Although they cannot fly, they are excellent "
     "swimmers, using their wings as flippers. Emperor penguins breed during the Antarctic winter; the male "
     "keeps the egg warm on his feet for about two months while the female feeds at sea. Many penguin "
     "species are threatened by warming oceans and reduced food supplies."),
     ["Where do penguins mostly live?", "Who keeps the emperor penguin egg warm?",
      "What threatens many penguin species?"]),
    (("The city council voted on Monday to turn the old railway line into a walking and cycling path. The "
     "path will be eight kilometers long and connect three neighborhoods with the city center. Construction "
     "is expected to begin next spring and take about eighteen months. The project will be paid for partly "
     "by a national grant for sustainable transport."),
     ["What will the old railway line become?", "How long will the path be?",
      "How will the project be funded?"]),
    (("Volcanoes form where molten rock, called magma, rises from deep inside the Earth. When magma reaches "
     "the surface it is called lava. Some volcanoes erupt explosively, throwing ash high into the air, while "
     "others release lava slowly in rivers. Volcanic soil is often very fertile, which is why farms are "
     "frequently found on the slopes of dormant volcanoes."),
     ["What is magma called when it reaches the surface?", "How do volcanic eruptions differ?",
      "Why are farms often found near volcanoes?"]),
    (("Our online store ships orders within two working days. Delivery inside the country is free for orders "
     "above fifty dollars; smaller orders cost five dollars to ship. Customers can return unused items within "
     "thirty days for a full refund, but sale items can only be exchanged. Refunds are paid to the original "
     "payment method within a week of receiving the return."),
     ["When is delivery free?", "Can sale items be refunded?", "How are refunds paid?"]),
    (("Mount Everest, on the border between Nepal and China, is the highest mountain above sea level at about "
     "8,849 meters. The first confirmed ascent was made in 1953 by Edmund Hillary and Tenzing Norgay. Climbers "
     "usually need several weeks to get used to the thin air at base camps before attempting the summit. Most "
     "expeditions take place in May, when the weather is most stable."),
     ["How high is Mount Everest?", "Who made the first confirmed ascent?",
      "Why do most expeditions happen in May?"]),
    (("Sleep happens in cycles of roughly ninety minutes. Each cycle includes light sleep, deep sleep, and "
     "rapid eye movement sleep, during which most vivid dreams occur. Deep sleep is important for physical "
     "recovery, while REM sleep is linked to memory and learning. Adults typically go through four to six "
     "cycles each night."),
     ["How long is a sleep cycle?", "During which stage do most vivid dreams occur?",
      "What is deep sleep important for?"]),
    (("The chess club meets every Wednesday at six in the evening in room 204. New members of any level are "
     "welcome, and boards are provided. Once a month the club holds a rapid tournament with fifteen-minute "
     "games. Members who want to play in regional competitions should speak to the club secretary, Ana, "
     "before the end of the month."),
     ["When and where does the chess club meet?", "How long are the tournament games?",
      "Who should members talk to about regional competitions?"]),
    (("Wind turbines turn the energy of moving air into electricity. The wind spins the blades, which turn a "
     "shaft connected to a generator. Turbines are usually placed on hills, open plains, or at sea, where "
     "winds are stronger and steadier. Because wind does not blow all the time, power grids combine wind "
     "energy with other sources and, increasingly, with large batteries."),
     ["How does a wind turbine produce electricity?", "Where are turbines usually placed?",
      "Why do grids combine wind with other sources?"]),
    (("The annual book sale at the public library runs from Friday to Sunday. Hardcover books cost two "
     "dollars and paperbacks one dollar, and on Sunday afternoon every bag of books costs five dollars. All "
     "money raised goes to the library's reading program for children. Donations of books in good condition "
     "are accepted until the Wednesday before the sale."),
     ["How much does a paperback cost at the sale?", "Where does the money go?",
      "Until when are book donations accepted?"]),
    (("Bread rises because yeast, a tiny fungus, feeds on sugars in the dough and releases carbon dioxide gas. "
     "The gas is trapped by a stretchy network of gluten proteins, which forms when flour is mixed with water "
     "and kneaded. Warm temperatures speed up the yeast, while cold slows it down. Baking kills the yeast and "
     "sets the structure of the loaf."),
     ["What makes bread rise?", "What traps the gas in the dough?",
      "How does temperature affect yeast?"]),
]
SUMMARIZE_TEMPLATES = [
    "Summarize the following paragraph in one sentence:\n\n{p}",
    "Give me a short summary of this text:\n\n{p}",
    "Read the paragraph below and list its three most important points.\n\n{p}",
]
RETRIEVAL_TEMPLATES = [
    "Answer the question using only the passage.\n\nPassage: {p}\n\nQuestion: {q}",
    "{p}\n\nBased on the text above, {ql}",
    "Here is some context:\n{p}\n\n{q} Answer briefly.",
]

# ---- translation: sentences x languages ----
TRANSLATE_SENTENCES = [
    "Good morning, how are you today?", "Where is the nearest train station?", "I would like a cup of coffee, please.",
    "The weather is beautiful this weekend.", "Can you help me find my keys?", "We are going to the beach tomorrow.",
    "My brother works as a doctor in a big hospital.", "This book is very interesting.",
    "How much does this jacket cost?", "I have been learning to play the guitar for two years.",
    "Please close the window, it is cold.", "The museum opens at ten o'clock.", "Do you speak English?",
    "I forgot my umbrella at home.", "Our meeting has been moved to Thursday.", "The children are playing in the garden.",
    "Thank you very much for your help.", "I don't understand the question.", "The restaurant is closed on Mondays.",
    "She reads the newspaper every morning.", "We need to buy bread and milk.", "What time does the movie start?",
    "The cat is sleeping on the sofa.", "I am looking forward to seeing you.", "It is too late to call him now.",
    "The train was delayed by twenty minutes.", "My favorite season is autumn.",
    "Could you speak a little more slowly?", "There is a small bakery next to my house.",
    "He has never been to Japan.", "Turn left at the second traffic light.", "The soup is too hot to eat.",
    "I would like to book a table for two.", "Happy birthday! I hope you have a wonderful day.",
    "The library is quiet in the afternoon.", "We walked along the river after dinner.",
]
TRANSLATE_LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese"]
TRANSLATE_TEMPLATES = [
    "Translate into {lang}: \"{s}\"",
    "How do you say \"{s}\" in {lang}?",
    "Translate the following sentence to {lang}.\n\n{s}",
]
TRANSLATE_BACK = [  # (language, sentence) pairs to translate into English
    ("French", "Je voudrais un billet pour Paris, s'il vous plaît."),
    ("French", "Il fait très froid ce matin."),
    ("French", "Nous avons mangé au restaurant hier soir."),
    ("Spanish", "¿Dónde está la biblioteca?"),
    ("Spanish", "Me gusta mucho leer libros de historia."),
    ("Spanish", "Mañana vamos a visitar a mis abuelos."),
    ("German", "Ich habe heute keine Zeit."),
    ("German", "Das Wetter ist heute sehr schön."),
    ("German", "Kannst du mir bitte helfen?"),
    ("Italian", "Vorrei un bicchiere d'acqua."),
    ("Italian", "La stazione è vicino al centro."),
    ("Portuguese", "Eu gosto de caminhar na praia."),
]

# ---- maths word problems: templates with numbers drawn from a seeded generator ----
MATH_TEMPLATES = [
    "A shop sells pencils for {a} cents each. How much do {b} pencils cost in dollars?",
    "Tom has {a} apples. He gives {b} to his sister and buys {c} more. How many apples does he have now?",
    "A train travels at {a} km per hour. How far does it go in {b} hours?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "There are {a} students in a class and {b} of them are girls. What percentage of the class are boys?",
    "A recipe needs {b} eggs for {a} people. How many eggs are needed for {c} people?",
    "Sarah saves {a} dollars every week. How many weeks does she need to save {d} dollars?",
    "A car uses {b} liters of fuel per 100 km. How much fuel is needed for a trip of {d} km?",
    "The price of a bike is {d} dollars. It is on sale for {b}% off. What is the sale price?",
    "A water tank holds {d} liters. It is filled at {a} liters per minute. How long does it take to fill it?",
    "If {a} workers can build a wall in {b} days, how long would {c} workers take, working at the same rate?",
    "A baker makes {a} loaves a day. How many loaves does she make in {b} weeks?",
    "Anna is {a} years old. Her father is {c} years older than three times her age. How old is her father?",
    ("A box contains {a} red balls and {b} blue balls. If you pick one ball at random, what is the probability "
    "that it is red?"),
    "What is the sum of all whole numbers from 1 to {d}?",
    "A phone plan costs {a} dollars a month plus {b} cents per minute. What is the bill for {d} minutes?",
    ("A cyclist rides {a} km in the morning and {b} km in the afternoon, for {c} days. How far does she ride in "
    "total?"),
    "Solve for x: {a}x + {b} = {d}.",
    "A square garden has a side of {a} meters. How many meters of fence are needed to go around it?",
    "A class of {d} students goes on a trip. Each bus holds {a} students. How many buses are needed?",
    ("The temperature was {b} degrees in the morning and rose by {a} degrees by noon, then fell by {c} degrees "
    "in the evening. What was the evening temperature?"),
    "A book has {d} pages. If Leo reads {a} pages a day, how many days will it take him to finish it?",
]

# ---- creative writing: forms x subjects ----
CREATIVE_FORMS = [
    "Write a short poem about {s}.", "Write a haiku about {s}.", "Write a very short story about {s}.",
    "Write a limerick about {s}.", "Write the opening paragraph of a novel about {s}.",
    "Write a short dialogue between two friends about {s}.", "Describe {s} as if you were a travel writer.",
    "Write a children's bedtime story about {s}.", "Write a diary entry from the point of view of {s}.",
    "Write a product description for {s}, in a playful tone.",
]
CREATIVE_SUBJECTS = [
    "the ocean at night", "a robot learning to paint", "autumn leaves", "a lost umbrella", ("the first day of "
    "spring"), "a lighthouse keeper", "a cat who wants to be a detective", "a city in the rain", "an old oak tree",
    "a dragon who is afraid of fire", "a train journey through the mountains", "a snowman in summer",
    "friendship", "a tiny village on an island", "the moon", "a time traveler's breakfast", "a busy kitchen",
    "a library at midnight", "a brave little mouse", "a garden after a storm", "the last bus home",
    "a penguin who wants to fly", "a message in a bottle", "coffee in the morning", "a forgotten toy",
    "a hot air balloon", "the sound of rain", "a kind giant", "a market on a Saturday morning",
    "a spaceship's first landing",
]

# ---- lists and how-tos ----
HOWTO_TEMPLATES = [
    "How do I {t}? Give me step-by-step instructions.",
    "List the steps to {t}.",
    "What's the easiest way to {t}?",
    "Give me a checklist for how to {t}.",
]
HOWTO_TASKS = [
    "change a flat bicycle tire", "make a cup of tea", "set up a new email account", "plant a tree",
    "write a cover letter", "bake chocolate chip cookies", "back up my computer", "tie a tie",
    "make a simple budget spreadsheet", "prepare for a job interview", "clean a laptop keyboard",
    "start a small herb garden", "create a strong password", "boil an egg", "organize a closet",
    "make pancakes", "learn to juggle three balls", "paint a room", "make a paper airplane",
    "hang a picture on a wall", "set up a fish tank", "cook rice on the stove", "write a short speech",
    "plan a road trip", "make homemade pizza dough", "install a Python package with pip",
    "create a git repository", "sew a button back on a shirt", "make a smoothie", "wash a wool sweater",
    "start running as a beginner", "make a to-do list that actually works", "train a dog to sit",
    "brew coffee with a French press", "prepare a presentation", "make a simple website with HTML",
    "fold a fitted sheet", "unclog a sink", "make a cheese sandwich", "study for a math exam",
]
LIST_PROMPTS = [
    "List ten healthy snacks.",
    "Give me five tips for writing clear emails.",
    "List some common houseplants that are easy to care for.",
    "Name seven countries in South America.",
    "List the planets of the solar system in order.",
    "Give me a list of fun outdoor activities for kids.",
    "List five famous painters and one work by each.",
    "What are the main food groups? List them with examples.",
    "List eight useful keyboard shortcuts.",
    "Give me a packing list for a beach holiday.",
    "List six ways to save energy at home.",
    "Name five musical instruments and describe each in one sentence.",
    "List the days of the week in Spanish.",
    "Give me ten ideas for a blog post about cooking.",
    "List common symptoms of a cold.",
    "List five programming languages and what each is often used for.",
    "Give me a list of questions to ask a landlord before renting.",
    "List the primary and secondary colors.",
    "Give me six ideas for a science project.",
    "List some good habits for healthy teeth.",
]


def _shuffled(items: list, rng: random.Random) -> list:
    items = list(items)
    rng.shuffle(items)
    return items


def _chat(rng: random.Random) -> list[str]:
    return list(CHAT)


def _explain(rng: random.Random) -> list[str]:
    # Each topic once, with a template drawn per topic; then a second pass for more variety.
    out = [rng.choice(EXPLAIN_TEMPLATES).format(t=t) for t in EXPLAIN_TOPICS]
    out += [rng.choice(EXPLAIN_TEMPLATES).format(t=t) for t in rng.sample(EXPLAIN_TOPICS, 26)]
    return out


def _code_write(rng: random.Random) -> list[str]:
    return [rng.choice(CODE_TEMPLATES).format(lang=lang, task=task)
            for task in CODE_TASKS for lang in rng.sample(CODE_LANGUAGES, 3)]


def _code_explain(rng: random.Random) -> list[str]:
    return [q.format(lang=lang, code=code) for lang, code in CODE_SNIPPETS for q in rng.sample(CODE_QUESTIONS, 4)]


def _summarize(rng: random.Random) -> list[str]:
    return [t.format(p=p) for p, _ in PASSAGES for t in SUMMARIZE_TEMPLATES]


def _retrieval(rng: random.Random) -> list[str]:
    out = []
    for p, questions in PASSAGES:
        for q in questions:
            t = rng.choice(RETRIEVAL_TEMPLATES)
            out.append(t.format(p=p, q=q, ql=q[0].lower() + q[1:]))
    return out


def _translate(rng: random.Random) -> list[str]:
    return [rng.choice(TRANSLATE_TEMPLATES).format(lang=lang, s=s)
            for s in TRANSLATE_SENTENCES for lang in rng.sample(TRANSLATE_LANGUAGES, 2)] + [
        f"Translate this {lang} sentence into English: \"{s}\"" for lang, s in TRANSLATE_BACK]


def _math(rng: random.Random) -> list[str]:
    out = []
    for t in MATH_TEMPLATES:
        for _ in range(4):
            a, b, c = rng.randint(2, 12), rng.randint(2, 9), rng.randint(2, 15)
            d = rng.choice([40, 60, 90, 100, 120, 150, 200, 240, 300, 360, 500])
            out.append(t.format(a=a, b=b, c=c, d=d))
    return out


def _creative(rng: random.Random) -> list[str]:
    out = []
    for s in CREATIVE_SUBJECTS:
        for form in rng.sample(CREATIVE_FORMS, 3):
            out.append(form.format(s=s))
    return out


def _howto(rng: random.Random) -> list[str]:
    out = [t.format(t=task) for task in HOWTO_TASKS for t in rng.sample(HOWTO_TEMPLATES, 2)]
    return out + list(LIST_PROMPTS)


_BUILDERS = {"chat": _chat, "explain": _explain, "code_write": _code_write, "code_explain": _code_explain,
             "summarize": _summarize, "translate": _translate, "math": _math, "retrieval": _retrieval,
             "creative": _creative, "howto": _howto}


def build_prompt_set(seed: int = SEED) -> list[dict]:
    """All prompt records, deterministic for a seed: categories interleaved round-robin (so the first N
    records cover every category), one in HELDOUT_EVERY of each category held out, staggered across
    categories so that every round of the interleaving holds some out (any prefix keeps a held-out share)."""
    per_category: dict[str, list[dict]] = {}
    for c, cat in enumerate(CATEGORIES):
        rng = random.Random(f"{seed}:{cat}")
        texts = list(dict.fromkeys(_BUILDERS[cat](rng)))  # drop exact duplicates, keep order
        texts = _shuffled(texts, rng)
        per_category[cat] = [
            {"messages": [{"role": "user", "content": text}],
             "split": "heldout" if i % HELDOUT_EVERY == c % HELDOUT_EVERY else "train", "category": cat}
            for i, text in enumerate(texts)]
    records: list[dict] = []
    longest = max(len(v) for v in per_category.values())
    for i in range(longest):
        for cat in CATEGORIES:
            if i < len(per_category[cat]):
                records.append(per_category[cat][i])
    return [{"id": n, **rec} for n, rec in enumerate(records)]


def write_prompt_set(path: Path = PROMPTS_FILE, seed: int = SEED) -> int:
    """Write the prompt set as JSONL; returns the number of records."""
    records = build_prompt_set(seed)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records)
    return len(records)


def load_prompts(path: str | Path | None = None, split: str | None = None) -> list[dict]:
    """Prompt records from a JSONL file (default: the shipped set), optionally one split only.

    Each line needs `messages` (a list of {role, content}); `split` defaults to "train", `category` to
    "general", `id` to the line's index."""
    p = Path(path) if path is not None else PROMPTS_FILE
    if split is not None and split not in SPLITS:
        raise InputError(f"split must be one of {SPLITS}, got {split!r}")
    records = []
    for n, rec in read_prompt_file(p, chat_only=True):
        rec = {"id": rec.get("id", n - 1), "messages": rec["messages"], "split": rec.get("split", "train"),
               "category": rec.get("category", "general")}
        if rec["split"] not in SPLITS:
            raise InputError(f"{p}:{n}: split must be one of {SPLITS}, got {rec['split']!r}")
        records.append(rec)
    return [r for r in records if split is None or r["split"] == split]


def iter_categories(records: list[dict]) -> Iterator[tuple[str, int]]:
    """(category, count) pairs in first-seen order."""
    counts: dict[str, int] = {}
    for r in records:
        counts[r["category"]] = counts.get(r["category"], 0) + 1
    yield from counts.items()


if __name__ == "__main__":
    n = write_prompt_set()
    recs = load_prompts()
    print(f"wrote {n} prompts to {PROMPTS_FILE}: " + ", ".join(f"{c} {k}" for c, k in iter_categories(recs)))
    print(f"held out: {sum(r['split'] == 'heldout' for r in recs)}")
