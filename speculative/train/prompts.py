"""The prompts heads are trained on (the target's own greedy answers to them) and those held out.

None of them is a prompt of the benchmarks (bench/), so acceptance measured there is on prompts the
heads never saw; `HELD_OUT` are more of the same kinds for `speculative.train`'s own evaluation.
"""

from __future__ import annotations

CODE = [
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Write a Python class for a stack with push, pop, peek and is_empty methods.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that flattens a nested list of arbitrary depth.",
    "Write a Python function that counts word frequencies in a text and returns the ten most common.",
    "Write a Python function that reads a CSV file and returns the average of one column.",
    "Write a binary search function in Python that returns the index of a target or -1.",
    "Write a Python function that removes duplicates from a list while keeping the order.",
    "Write a Python dataclass for a 2D point with a method for the distance to another point.",
    "Write a Python function that validates an email address with a regular expression.",
    "Write a Python generator that yields the prime numbers below n.",
    "Write a Python function that transposes a matrix given as a list of lists.",
    "Write a Python function that groups a list of dictionaries by the value of one key.",
    "Write a Python decorator that times a function and prints how long it took.",
    "Write a Python function that converts a Roman numeral to an integer.",
    "Write a Python function that finds the longest common prefix of a list of strings.",
    "Write a Python function that implements quicksort.",
    "Write a Python class for a bank account with deposit, withdraw and balance, refusing overdrafts.",
    "Write a Python function that parses a query string like 'a=1&b=2' into a dictionary.",
    "Write a Python function that checks whether parentheses in a string are balanced.",
    "Write a Python function that computes the factorial of n recursively, with a docstring and type hints.",
    "Write a Python script that prints a multiplication table from 1 to 9.",
    "Write a JavaScript function that debounces another function.",
    "Write a SQL query that returns the five customers with the highest total order amount.",
    "Write a Python function that merges two dictionaries, summing the values of common keys.",
    "Write unit tests with pytest for a function add(a, b) that adds two numbers.",
    "Write a Python function that rotates a list by k positions to the right.",
    "Write a Python function that returns all permutations of a string.",
]
PROSE = [
    "Explain in a paragraph how a hash table works.",
    "Write a short paragraph about the history of the printing press.",
    "Describe what photosynthesis is in simple terms.",
    "Explain the difference between a process and a thread.",
    "Write a short story opening about a lighthouse keeper.",
    "Summarise the water cycle in a few sentences.",
    "Explain what recursion is to a beginner programmer.",
    "Describe the rules of chess in one paragraph.",
]
CHAT = [
    "Hello! What can you help me with today?",
    "What are some tips for writing readable code?",
    "Can you suggest a name for a cat that likes to sleep all day?",
    "How do I make a good cup of coffee?",
    "What is the best way to prepare for a job interview?",
    "Give me three ideas for a weekend project with a Raspberry Pi.",
]
TRAIN = CODE + PROSE + CHAT

HELD_OUT = [
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that reverses the words of a sentence.",
    "Write a Python function that returns the second largest number in a list.",
    "Write a Python class for a queue built from two stacks.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function that computes the greatest common divisor of two integers.",
]
