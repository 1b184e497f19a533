"""A labelled retrieval task for embedding models, written for the study's closing-note
run on all-MiniLM-L6-v2: for a sentence, pick the sentence of the same topic among five
(one per topic). Sentences are original; topics are the labels."""

from __future__ import annotations

import json
import sys

import numpy as np

TOPICS = {
    "cooking": ["Simmer the onions slowly until they turn golden and sweet.",
                "Knead the dough for ten minutes, then let it rise in a warm place.",
                "A pinch of salt brings out the sweetness of the tomato sauce.",
                "Sear the steak on a very hot pan before roasting it.",
                "Whisk the eggs with sugar until the mixture is pale and thick.",
                "Season the soup at the end, once it has reduced."],
    "weather": ["Heavy rain is expected across the coast tomorrow afternoon.",
                "A cold front will bring snow to the mountains overnight.",
                "Temperatures will climb above thirty degrees by the weekend.",
                "Strong winds may knock down branches during the storm.",
                "Morning fog should clear by midday, leaving sunny skies.",
                "The forecast calls for thunderstorms and hail in the evening."],
    "finance": ["The central bank raised interest rates by a quarter point.",
                "Shares fell sharply after the company missed its earnings target.",
                "Investors moved money into government bonds as markets slid.",
                "The quarterly report showed revenue growing faster than costs.",
                "Inflation eased slightly, but remains above the bank's target.",
                "The firm plans to buy back stock worth two billion dollars."],
    "medicine": ["The patient was given antibiotics to treat the infection.",
                 "Regular exercise lowers the risk of heart disease.",
                 "The vaccine trial enrolled thousands of volunteers.",
                 "Doctors recommend checking blood pressure once a year.",
                 "The surgeon repaired the torn ligament in the knee.",
                 "Symptoms include fever, cough and tiredness for several days."],
    "programming": ["The function returns early when the list is empty.",
                    "We fixed the memory leak by closing the file handle.",
                    "Compile the project and run the unit tests before merging.",
                    "The query was slow until we added an index on the column.",
                    "A race condition appeared when two threads wrote the counter.",
                    "Refactor the class so each module does one thing."],
    "football": ["The striker scored twice in the second half.",
                 "The goalkeeper saved a penalty in the final minute.",
                 "The coach changed the formation after the first goal.",
                 "Fans filled the stadium for the derby on Sunday.",
                 "The defender was sent off for a late tackle.",
                 "The club signed a young midfielder from abroad."],
    "music": ["The orchestra tuned their instruments before the concert.",
              "She practised the piano sonata every evening for months.",
              "The band released a new album with ten songs.",
              "The drummer kept a steady beat through the long solo.",
              "The choir sang in four-part harmony.",
              "He wrote the melody first and the lyrics later."],
    "gardening": ["Water the tomato plants early in the morning.",
                  "Prune the roses in late winter before new growth starts.",
                  "Add compost to the soil to feed the vegetables.",
                  "Slugs ate most of the lettuce seedlings overnight.",
                  "Plant the bulbs in autumn for flowers in spring.",
                  "The hedge needs trimming twice a year."],
}


def examples(n: int, seed: int, candidates: int = 5) -> list[dict]:
    rng = np.random.default_rng(seed)
    names = sorted(TOPICS)
    rows = []
    for _ in range(n):
        picked = rng.choice(len(names), size=candidates, replace=False)
        topic = names[picked[0]]
        query, match = rng.choice(len(TOPICS[topic]), size=2, replace=False)
        options = [TOPICS[topic][match]] + [TOPICS[names[t]][int(rng.integers(6))] for t in picked[1:]]
        order = rng.permutation(candidates)
        rows.append({"text": TOPICS[topic][query], "candidates": [options[i] for i in order],
                     "label": int(np.flatnonzero(order == 0)[0]), "topic": topic})
    return rows


if __name__ == "__main__":  # python benchmarks/study/topics.py N SEED > eval.jsonl
    for row in examples(int(sys.argv[1]), int(sys.argv[2])):
        print(json.dumps(row))
