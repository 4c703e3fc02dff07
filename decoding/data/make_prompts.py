"""Writes prompts.jsonl: the project's original prompt set with a fixed train/test split.

Run `python decoding/data/make_prompts.py` after editing; the JSONL is committed. Each line:
{"question_id", "category", "split", "turns": [user message, ...]}. Every 3rd prompt of each category
(index % 3 == 2) is in the test split.
"""
import json
from pathlib import Path

P = {}

P["code_completion"] = [
    "Complete this Python function:\n\ndef is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same forwards and backwards, ignoring case and spaces.\"\"\"\n",
    "Complete the function body:\n\ndef fibonacci(n):\n    \"\"\"Return a list with the first n Fibonacci numbers.\"\"\"\n",
    "Finish this class so that it works as a stack:\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "Write the rest of this JavaScript function:\n\nfunction countVowels(text) {\n  // return the number of vowels in text\n",
    "Complete this Python function:\n\ndef merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "Complete the SQL query that returns the five customers with the highest total order amount:\n\nSELECT c.name, SUM(o.amount) AS total\nFROM customers c\n",
    "Complete this function:\n\ndef word_frequencies(text):\n    \"\"\"Return a dict mapping each lowercase word in text to its count.\"\"\"\n",
    "Write the body of this Python function:\n\ndef celsius_to_fahrenheit(celsius):\n",
    "Complete this binary search:\n\ndef binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n",
    "Finish this Python function that reads a CSV file:\n\nimport csv\n\ndef read_rows(path):\n    \"\"\"Return the rows of the CSV file at path as a list of dicts.\"\"\"\n",
    "Complete this function:\n\ndef flatten(nested):\n    \"\"\"Flatten a list of lists into a single list.\"\"\"\n",
    "Complete the Python function:\n\ndef count_lines(path):\n    \"\"\"Return how many lines the text file at path has.\"\"\"\n",
    "Complete this Rust function:\n\nfn max_of(values: &[i32]) -> Option<i32> {\n",
    "Complete this function that checks whether a number is prime:\n\ndef is_prime(n):\n",
    "Complete the Python class:\n\nclass Counter:\n    \"\"\"Counts how many times increment() was called.\"\"\"\n    def __init__(self):\n",
]

P["code_edit"] = [
    "Rename the variable x to total in this code and return the whole code:\n\ndef add_all(numbers):\n    x = 0\n    for n in numbers:\n        x = x + n\n    return x\n",
    "Add type hints to this function and return the whole function:\n\ndef greet(name, times):\n    for i in range(times):\n        print('Hello, ' + name)\n",
    "Add a docstring to this function and return the whole function:\n\ndef area(width, height):\n    return width * height\n",
    "Convert this for loop to a list comprehension and return the code:\n\nsquares = []\nfor i in range(10):\n    squares.append(i * i)\n",
    "Fix the bug in this function and return the corrected code:\n\ndef average(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values) + 1\n",
    "Rewrite this code to use f-strings and return the whole code:\n\nname = 'Ada'\nage = 36\nprint('Name: ' + name + ', age: ' + str(age))\nprint('Next year ' + name + ' will be ' + str(age + 1))\n",
    "Add error handling for a missing file to this function and return the whole function:\n\ndef load(path):\n    with open(path) as f:\n        return f.read()\n",
    "Rename the function calc to compute_discount everywhere and return the code:\n\ndef calc(price, rate):\n    return price * (1 - rate)\n\nprint(calc(100, 0.2))\nprint(calc(50, 0.1))\n",
    "Replace the print calls with logging calls in this code and return it:\n\ndef process(items):\n    print('start')\n    for item in items:\n        print('item', item)\n    print('done')\n",
    "Make this function iterative instead of recursive and return the code:\n\ndef factorial(n):\n    if n <= 1:\n        return 1\n    return n * factorial(n - 1)\n",
    "Add a parameter `sep` with default ', ' to this function and return it:\n\ndef join_names(names):\n    return ', '.join(names)\n",
    "Convert this Python class to a dataclass and return the code:\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "Sort the imports of this module alphabetically and return the whole module:\n\nimport sys\nimport json\nimport os\nimport re\n\nprint(os.getcwd(), sys.argv, json.dumps({}), re.escape('.'))\n",
    "Change this function to return None instead of -1 when the item is missing, and return the code:\n\ndef find(items, wanted):\n    for i, item in enumerate(items):\n        if item == wanted:\n            return i\n    return -1\n",
    "Translate this JavaScript to Python and keep the same names:\n\nfunction double(values) {\n  return values.map(v => v * 2);\n}\n",
]

P["summarization"] = [
    "Summarize in two sentences:\n\nThe town library opened a new wing this spring. It holds a reading room, a children's corner with picture books, and twelve computers that anyone can use for free. The library also extended its opening hours to nine in the evening on weekdays, after many students asked for a quiet place to study.",
    "Summarize this passage in one sentence:\n\nBees visit flowers to collect nectar and pollen. As they move from flower to flower, pollen sticks to their bodies and is carried to other plants, which allows those plants to make seeds. Without bees and other pollinators, many fruits and vegetables would be much harder to grow.",
    "Give a short summary of this text:\n\nThe company reported that sales grew by eight percent in the last quarter, mostly because of strong demand for its new bicycles. Costs also rose, as steel and shipping became more expensive, so profit grew only slightly. The company plans to open two new shops next year.",
    "Summarize the following in three bullet points:\n\nRegular exercise strengthens the heart and lungs. It also helps people sleep better and can improve mood by reducing stress. Doctors suggest at least thirty minutes of moderate activity, such as brisk walking, on most days of the week.",
    "Summarize this story in two sentences:\n\nMaria found an old map in her grandmother's attic. The map showed a path through the forest behind the house, ending at a large oak tree. She followed it one Saturday morning and, under the roots of the oak, found a tin box full of letters her grandmother had written as a girl.",
    "Summarize the main point of this paragraph:\n\nWater expands when it freezes, which is unusual, because most substances shrink when they become solid. This is why ice floats on lakes: it is less dense than the liquid water below it. The floating ice insulates the water, so fish can survive the winter.",
    "Summarize in one sentence:\n\nThe city council voted to turn the old train station into a market hall. Local farmers will sell fruit, vegetables and cheese there on weekends, and the building will host concerts in the evenings. Work on the roof starts in March.",
    "Write a short summary of this email:\n\nHi team, the server upgrade planned for Friday is moved to Monday at 8 am because the new hardware arrived late. The website will be offline for about an hour. Please save your work before then and tell your customers about the short outage. Thanks, Sam",
    "Summarize this passage for a child:\n\nThe Moon does not make its own light. It shines because it reflects light from the Sun. As the Moon travels around the Earth, we see different amounts of its sunlit side, which is why it seems to change shape over a month.",
    "Summarize in two sentences:\n\nA study followed two thousand adults for ten years and found that those who ate more vegetables had fewer heart problems. The researchers say the result does not prove that vegetables caused the difference, since people who eat well often also exercise more and smoke less.",
    "Summarize the following paragraph:\n\nSolar panels turn sunlight into electricity. Their price has fallen sharply over the last decade, so many households now put them on their roofs. On sunny days a home can produce more power than it needs and sell the rest back to the grid.",
    "Summarize this meeting note in one sentence:\n\nWe agreed to release version 2.0 on the fifteenth. Anna will finish the documentation, Ben will fix the two open login bugs, and Chen will prepare the release announcement. We will meet again on Thursday to check progress.",
    "Summarize in one sentence:\n\nThe museum's new exhibition shows tools used by farmers two hundred years ago, including wooden ploughs, hand-made baskets and iron sickles. Visitors can try some of the tools in a small garden outside.",
    "Give a one-sentence summary:\n\nThe bakery on Main Street will close for two weeks in August so the owners can replace the old ovens. During that time, their bread will be sold at the farmers' market on Saturdays.",
    "Summarize this review in one sentence:\n\nThe phone has a bright screen and a battery that easily lasts two days. The camera is good in daylight but struggles at night, and the phone is heavier than most. For the price, it is a solid choice.",
]

P["qa"] = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "How many legs does a spider have?",
    "What is the difference between weather and climate?",
    "Who wrote the play Romeo and Juliet?",
    "What does a CPU do in a computer?",
    "What is photosynthesis?",
    "How do vaccines work?",
    "What is the boiling point of water at sea level in Celsius?",
    "What is the largest planet in our solar system?",
    "What causes the seasons on Earth?",
    "What is an API in software?",
    "Why do we have leap years?",
    "What is the difference between a virus and a bacterium?",
    "What is the speed of light, approximately?",
]

P["math"] = [
    "What is 17 times 23? Show your steps.",
    "A shirt costs 40 dollars and is on sale for 25 percent off. What is the sale price? Explain.",
    "Solve for x: 3x + 7 = 22. Show each step.",
    "What is the sum of the integers from 1 to 100? Explain how you got it.",
    "A train travels 180 kilometers in 2 hours. What is its average speed? Show your work.",
    "If a rectangle has a perimeter of 30 and a width of 5, what is its area? Show the steps.",
    "What is 15 percent of 240? Show how you calculate it.",
    "Simplify the fraction 84/126 and explain each step.",
    "A recipe needs 3 eggs for 12 cookies. How many eggs are needed for 30 cookies? Explain.",
    "What is the next number in the sequence 2, 6, 12, 20, 30? Explain the pattern.",
    "Solve the system: x + y = 10 and x - y = 4. Show your steps.",
    "How many minutes are there in a week? Show the calculation.",
    "What is the average of 12, 15, 20 and 33? Show your work.",
    "Convert 0.375 to a fraction in lowest terms. Explain.",
    "If you roll two dice, what is the probability that the sum is 7? Explain.",
]

P["chat_writing"] = [
    "Write a short poem about autumn leaves.",
    "Give me three tips for staying focused while studying.",
    "Write a friendly message inviting a neighbour to a barbecue on Saturday.",
    "Tell me a short story about a robot who learns to paint.",
    "What should I pack for a weekend camping trip?",
    "Write a haiku about the sea.",
    "Suggest a name for a coffee shop that also sells books, and explain why.",
    "Write a thank-you note to a teacher.",
    "Describe a perfect Sunday morning in a few sentences.",
    "Give me some ideas for a birthday gift for my sister who likes gardening.",
    "Write a limerick about a cat who loves cheese.",
    "How can I make my morning routine more relaxing?",
    "Write a short motivational message for someone starting a new job.",
    "Describe the city of the future in a short paragraph.",
    "Write a two-line slogan for a bicycle shop.",
]

P["translation"] = [
    "Translate into French: The weather is nice today and I would like to go for a walk.",
    "Translate into Spanish: Where is the nearest train station?",
    "Translate into German: I have been learning to play the piano for two years.",
    "Translate into English: Je voudrais un café et un croissant, s'il vous plaît.",
    "Translate into English: El libro está encima de la mesa.",
    "Translate into Italian: We are going to the beach tomorrow morning.",
    "Translate into French: Thank you very much for your help yesterday.",
    "Translate into English: Ich wohne seit fünf Jahren in Berlin.",
    "Translate into Spanish: My brother works at a hospital in the city.",
    "Translate into Portuguese: Good morning, how are you?",
    "Translate into English: Il pleut depuis ce matin.",
    "Translate into German: The children are playing in the garden.",
    "Translate into French: Could you please close the window?",
    "Translate into Spanish: I like to read books in the evening.",
    "Translate into English: Dove si trova il museo?",
]

P["extraction"] = [
    "Extract all the dates from this text as a list:\n\nThe contract was signed on 3 March 2021, renewed on 1 April 2022, and ends on 31 December 2024.",
    "List the names of all people mentioned:\n\nAt the meeting, Laura presented the budget, Tom asked about the timeline, and Priya agreed to write the report with help from Daniel.",
    "Extract the product names and prices as JSON:\n\nToday's offers: apples 2.50 per kilo, bread 3.20, milk 1.10 per litre, and cheese 6.75.",
    "Which cities are mentioned in this text?\n\nShe grew up in Lyon, studied in Madrid, worked for five years in Toronto and now lives in Osaka.",
    "Extract the email addresses from this text:\n\nFor support write to help@example.com; for sales contact sales@example.org or our manager at j.smith@example.net.",
    "From this text, list every number together with what it counts:\n\nThe school has 420 students, 31 teachers, 18 classrooms and 2 gyms.",
    "Extract the ingredients from this recipe as a list:\n\nMix 200 g of flour with 2 eggs and 300 ml of milk. Add a pinch of salt and fry the batter in butter.",
    "Pull out the key facts (who, what, when, where) from this sentence:\n\nOn Tuesday, the mayor of Springfield opened a new bridge over the river Elm.",
    "List the programming languages mentioned:\n\nOur backend is written in Go and Python, the mobile apps use Kotlin and Swift, and the website is built with TypeScript.",
    "Extract the phone numbers from this text:\n\nCall the front desk at 555-0134 or the night manager at 555-0199. Fax: 555-0100.",
    "Extract the start and end time of each event:\n\nBreakfast is from 7:00 to 9:00, the workshop runs from 9:30 to 12:00, and lunch is served from 12:15 to 13:30.",
    "Extract the author, title and year from this citation:\n\nSmith, J. (2019). Gardening for Beginners. Green Press.",
    "List the countries and their capitals mentioned in this text:\n\nWe visited Norway, whose capital is Oslo, then Portugal with its capital Lisbon, and finally Kenya, where we stayed in Nairobi, the capital.",
    "Extract every colour mentioned in this text:\n\nThe red door opened onto a hall with green walls, a yellow lamp and a blue rug.",
    "Extract the order number and the delivery date:\n\nYour order #48213 has shipped and should arrive on 14 June.",
]

rows = []
for category, prompts in P.items():
    for i, text in enumerate(prompts):
        rows.append({"question_id": f"{category}-{i:02d}", "category": category,
                     "split": "test" if i % 3 == 2 else "train", "turns": [text]})
out = Path(__file__).with_name("prompts.jsonl")
out.write_text("".join(json.dumps(r) + "\n" for r in rows))
print(f"wrote {len(rows)} prompts in {len(P)} categories to {out}")
