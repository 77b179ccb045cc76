"""Writes the example task of the README's "Your own task": support messages of a made-up shop,
each routed to one of eight teams. `python examples/routing/make_data.py` rewrites train.csv (480
rows), dev.csv (96) and test.csv (64, the label column too, to check predictions by); the same
seed gives the same files.

Each message joins an opening, a request of its team's and a closing, drawn from the phrases below
(written for this example); openings and closings are shared by all teams and say nothing of the
route. Training messages use the first nine requests of each team, dev and test messages the last
three: the model must route wording it has not seen, by the words a team's requests share.
"""

import csv
import os
import random

REQUESTS = {
    "billing": [
        "I was charged twice for my last order", "my invoice shows the wrong amount",
        "why did my card get billed again this month", "the payment went through but the "
        "invoice says unpaid", "can you send me a copy of the invoice", "I see an extra fee "
        "on my statement", "the tax on my bill looks wrong", "please update the billing "
        "address on my invoices", "my credit card was declined although it is valid",
        "I need a receipt for my accountant", "the subscription charge doubled",
        "you billed me for a plan I cancelled",
    ],
    "shipping": [
        "my parcel has not arrived yet", "the tracking number does not work",
        "the package is stuck at the depot for a week", "can I change the delivery address",
        "the courier left the box at the wrong door", "when will my order be shipped",
        "delivery was promised for Monday and nothing came", "the parcel shows delivered but "
        "I never got it", "can you ship to another country", "I want express delivery instead",
        "the driver could not find my street", "how long does shipping take to the islands",
    ],
    "returns": [
        "I want to return the shoes, they are too small", "how do I send back a jacket",
        "the return label is missing from the box", "I sent the item back two weeks ago and "
        "have no refund", "can I exchange the shirt for a larger size", "the blender arrived "
        "broken and I want to return it", "is the return free of charge", "I would like my "
        "money back for the lamp", "the refund for my return has not come through",
        "can I return a gift without the receipt", "where do I drop off a return",
        "the exchanged item is the wrong colour again",
    ],
    "account": [
        "I cannot log in to my account", "please reset my password", "how do I change the "
        "email on my profile", "my account was locked after three tries", "I want to delete "
        "my account", "someone else may be using my login", "the two factor code never "
        "arrives", "how can I merge my two accounts", "I forgot the username I signed up "
        "with", "please update my phone number", "my profile shows someone else's name",
        "I want to stop the newsletter emails",
    ],
    "technical": [
        "the app crashes when I open the basket", "the website shows an error at checkout",
        "the page keeps loading forever", "the search returns nothing on my phone",
        "the app will not install on my tablet", "pictures of the products do not load",
        "the discount code field throws an error", "the site logs me out every minute",
        "the button to pay does nothing", "your app drains my battery", "the checkout page "
        "is blank in my browser", "notifications from the app stopped working",
    ],
    "sales": [
        "do you offer discounts for large orders", "I would like a quote for fifty chairs",
        "is the sofa available in green", "when will the new collection be in stock",
        "can a sales person call me about office furniture", "do you have a catalogue for "
        "businesses", "what is the price of the oak table", "can I reserve the last one in "
        "store", "do you sell gift cards", "is there a student discount",
        "I want to buy the display model", "can you beat the price I found elsewhere",
    ],
    "warranty": [
        "the kettle stopped working after four months", "is my washing machine still under "
        "warranty", "the zip broke after a few weeks of use", "can you repair the coffee "
        "machine under the guarantee", "the screen of the television has a dead line",
        "how long is the warranty on the vacuum cleaner", "the heater makes a burning smell "
        "after a month", "I need the warranty card for my fridge", "the handle came off the "
        "pan within the guarantee", "who repairs the drill while it is under warranty",
        "the headphones lost sound in one ear", "the mattress sags after half a year",
    ],
    "feedback": [
        "I just want to say the staff were lovely", "your delivery driver was very kind",
        "I am unhappy with how my complaint was handled", "the new website is much easier to "
        "use", "please pass my thanks to the team", "the store was messy and nobody helped",
        "I love the quality of your towels", "the waiting music on the phone is awful",
        "great service, I will order again", "I have a suggestion for your app",
        "the packaging uses too much plastic", "your prices have gone up too much",
    ],
}
OPENINGS = ["", "", "Hello, ", "Hi there, ", "Good morning, ", "Dear team, ", "Hey, ",
            "Excuse me, ", "Quick question: ", "Order 4471: ", "Hello again, ", "Hi, "]
CLOSINGS = ["", "", ".", "!", ". Thanks.", ". Thank you in advance.", ". Regards, Ana.",
            ", please help.", ". Can you look into it?", ". Best wishes, Tom.", "?",
            ". This is urgent."]
SIZES = {"train": 480, "dev": 96, "test": 64}


HELD_OUT = 3  # requests per team seen only in dev and test


def message(rng: random.Random, label: str, split: str) -> str:
  requests = REQUESTS[label]
  request = rng.choice(requests[:-HELD_OUT] if split == "train" else requests[-HELD_OUT:])
  text = rng.choice(OPENINGS) + request
  return text[0].upper() + text[1:] + rng.choice(CLOSINGS)


def main() -> None:
  rng = random.Random(2026)
  folder = os.path.dirname(os.path.abspath(__file__))
  labels = sorted(REQUESTS)
  for split, n in SIZES.items():
    rows = [(f"{split}-{i}", message(rng, labels[i % len(labels)], split), labels[i % len(labels)])
            for i in range(n)]
    rng.shuffle(rows)
    with open(os.path.join(folder, f"{split}.csv"), "w", newline="", encoding="utf-8") as f:
      writer = csv.writer(f)
      writer.writerow(["id", "text", "label"])
      writer.writerows(rows)


if __name__ == "__main__":
  main()
