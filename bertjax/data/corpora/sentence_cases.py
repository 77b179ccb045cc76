"""Texts with their right sentences: what a sentence segmenter is measured on (`python -m
bertjax.benchmark sentences`, tests/test_data_sentences.py).

GOLDEN_RULES: the 48 English "golden rules" of sentence segmentation, the public set that
pragmatic segmenters (the Ruby pragmatic_segmenter, pySBD) report their accuracy on: plain
stops, abbreviations, initials, numbers and money, lists, quotes and parentheses, e-mail and web
addresses, ellipses. Written out here from the published list, one (text, sentences) pair each.

OTHER_SCRIPTS: short texts of our own in scripts without Latin capitals after a stop (Cyrillic,
Greek, Devanagari, Arabic, Hangul) or without a space after one (Chinese, Japanese), with their
language code: where a rule of `[A-Z0-9]` after the stop finds no sentence at all.
"""

GOLDEN_RULES = (
    ("Hello World. My name is Jonas.", ["Hello World.", "My name is Jonas."]),
    ("What is your name? My name is Jonas.", ["What is your name?", "My name is Jonas."]),
    ("There it is! I found it.", ["There it is!", "I found it."]),
    ("My name is Jonas E. Smith.", ["My name is Jonas E. Smith."]),
    ("Please turn to p. 55.", ["Please turn to p. 55."]),
    ("Were Jane and co. at the party?", ["Were Jane and co. at the party?"]),
    ("They closed the deal with Pitt, Briggs & Co. at noon.",
     ["They closed the deal with Pitt, Briggs & Co. at noon."]),
    ("Let's ask Jane and co. They should know.", ["Let's ask Jane and co.", "They should know."]),
    ("They closed the deal with Pitt, Briggs & Co. It closed yesterday.",
     ["They closed the deal with Pitt, Briggs & Co.", "It closed yesterday."]),
    ("I can see Mt. Fuji from here.", ["I can see Mt. Fuji from here."]),
    ("St. Michael's Church is on 5th st. near the light.",
     ["St. Michael's Church is on 5th st. near the light."]),
    ("That is JFK Jr.'s book.", ["That is JFK Jr.'s book."]),
    ("I visited the U.S.A. last year.", ["I visited the U.S.A. last year."]),
    ("I live in the E.U. How about you?", ["I live in the E.U.", "How about you?"]),
    ("I live in the U.S. How about you?", ["I live in the U.S.", "How about you?"]),
    ("I work for the U.S. Government in Virginia.",
     ["I work for the U.S. Government in Virginia."]),
    ("I have lived in the U.S. for 20 years.", ["I have lived in the U.S. for 20 years."]),
    ("At 5 a.m. Mr. Smith went to the bank. He left the bank at 6 P.M. Mr. Smith then went to "
     "the store.",
     ["At 5 a.m. Mr. Smith went to the bank.", "He left the bank at 6 P.M.",
      "Mr. Smith then went to the store."]),
    ("She has $100.00 in her bag.", ["She has $100.00 in her bag."]),
    ("She has $100.00. It is in her bag.", ["She has $100.00.", "It is in her bag."]),
    ("He teaches science (He previously worked for 5 years as an engineer.) at the local "
     "University.",
     ["He teaches science (He previously worked for 5 years as an engineer.) at the local "
      "University."]),
    ("Her email is Jane.Doe@example.com. I sent her an email.",
     ["Her email is Jane.Doe@example.com.", "I sent her an email."]),
    ("The site is: https://www.example.50.com/new-site/awesome_content.html. Please check it out.",
     ["The site is: https://www.example.50.com/new-site/awesome_content.html.",
      "Please check it out."]),
    ("She turned to him, 'This is great.' she said.",
     ["She turned to him, 'This is great.' she said."]),
    ('She turned to him, "This is great." she said.',
     ['She turned to him, "This is great." she said.']),
    ('She turned to him, "This is great." She held the book out to show him.',
     ['She turned to him, "This is great."', "She held the book out to show him."]),
    ("Hello!! Long time no see.", ["Hello!!", "Long time no see."]),
    ("Hello?? Who is there?", ["Hello??", "Who is there?"]),
    ("Hello!? Is that you?", ["Hello!?", "Is that you?"]),
    ("Hello?! Is that you?", ["Hello?!", "Is that you?"]),
    ("1.) The first item 2.) The second item", ["1.) The first item", "2.) The second item"]),
    ("1.) The first item. 2.) The second item.",
     ["1.) The first item.", "2.) The second item."]),
    ("1) The first item 2) The second item", ["1) The first item", "2) The second item"]),
    ("1) The first item. 2) The second item.", ["1) The first item.", "2) The second item."]),
    ("1. The first item 2. The second item", ["1. The first item", "2. The second item"]),
    ("1. The first item. 2. The second item.", ["1. The first item.", "2. The second item."]),
    ("\u2022 9. The first item \u2022 10. The second item",
     ["\u2022 9. The first item", "\u2022 10. The second item"]),
    ("\u20439. The first item \u204310. The second item",
     ["\u20439. The first item", "\u204310. The second item"]),
    ("a. The first item b. The second item c. The third list item",
     ["a. The first item", "b. The second item", "c. The third list item"]),
    ("You can find it at N\u00b0. 1026.253.553. That is where the treasure is.",
     ["You can find it at N\u00b0. 1026.253.553.", "That is where the treasure is."]),
    ("She works at Yahoo! in the accounting department.",
     ["She works at Yahoo! in the accounting department."]),
    ("We make a good team, you and I. Did you see Albert I. Jones yesterday?",
     ["We make a good team, you and I.", "Did you see Albert I. Jones yesterday?"]),
    ("Thoreau argues that by simplifying one\u2019s life, \u201cthe laws of the universe will "
     "appear less complex. . . .\u201d",
     ["Thoreau argues that by simplifying one\u2019s life, \u201cthe laws of the universe will "
      "appear less complex. . . .\u201d"]),
    ('"Bohr [...] used the analogy of parallel stairways [...]" (Smith 55).',
     ['"Bohr [...] used the analogy of parallel stairways [...]" (Smith 55).']),
    ("If words are left off at the end of a sentence, and that is all that is omitted, indicate "
     "the omission with ellipsis marks (preceded and followed by a space) and then indicate the "
     "end of the sentence with a period . . . . Next sentence.",
     ["If words are left off at the end of a sentence, and that is all that is omitted, "
      "indicate the omission with ellipsis marks (preceded and followed by a space) and then "
      "indicate the end of the sentence with a period . . . .", "Next sentence."]),
    ("I never meant that.... She left the store.", ["I never meant that....", "She left the store."]),
    ("I wasn\u2019t really ... well, what I mean...see . . . what I'm saying, the thing is . . . I "
     "didn\u2019t mean it.",
     ["I wasn\u2019t really ... well, what I mean...see . . . what I'm saying, the thing is . . . "
      "I didn\u2019t mean it."]),
    ("One further habit which was somewhat weakened . . . was that of combining words into "
     "self-interpreting compounds. . . . The practice was not abandoned. . . .",
     ["One further habit which was somewhat weakened . . . was that of combining words into "
      "self-interpreting compounds.", ". . . The practice was not abandoned. . . ."]),
)

OTHER_SCRIPTS = (
    ("ru", "Москва — столица России. Город основан в 1147 году! Вы там были?",
     ["Москва — столица России.", "Город основан в 1147 году!", "Вы там были?"]),
    ("el", "Η Αθήνα είναι μια αρχαία πόλη. Έχει πολλά μουσεία.",
     ["Η Αθήνα είναι μια αρχαία πόλη.", "Έχει πολλά μουσεία."]),
    ("hi", "भारत एक विशाल देश है। यहाँ कई भाषाएँ बोली जाती हैं।",
     ["भारत एक विशाल देश है।", "यहाँ कई भाषाएँ बोली जाती हैं।"]),
    ("ar", "القاهرة عاصمة مصر. هل زرتها من قبل؟ إنها مدينة كبيرة.",
     ["القاهرة عاصمة مصر.", "هل زرتها من قبل؟", "إنها مدينة كبيرة."]),
    ("ko", "서울은 한국의 수도입니다. 인구가 아주 많습니다.",
     ["서울은 한국의 수도입니다.", "인구가 아주 많습니다."]),
    ("zh", "今天天气很好。我们去公园吧！你来吗？", ["今天天气很好。", "我们去公园吧！", "你来吗？"]),
    ("ja", "東京は日本の首都です。人口はとても多いです。", ["東京は日本の首都です。", "人口はとても多いです。"]),
)


def score(segment, cases=GOLDEN_RULES, language: str | None = "en") -> tuple[int, list[str]]:
  """How many of `cases` `segment(text, language)` splits right (sentences compared with their
  runs of white space made one space), and the texts it got wrong. `cases` are (text, sentences)
  pairs in `language`, or (language, text, sentences) triples."""
  right, wrong = 0, []
  for case in cases:
    lang, text, want = case if len(case) == 3 else (language, *case)
    got = [" ".join(s.split()) for s in segment(text, lang) if s.strip()]
    if got == want:
      right += 1
    else:
      wrong.append(text)
  return right, wrong
