"""An English text written for perfx's tests (golden logits, scoring): plain prose with numbers and names."""

GOLDEN_TEXT = (
    "Every morning the ferry leaves the harbour at seven, carrying commuters, bicycles and crates of fresh bread "
    "to the island. The crossing takes about forty minutes when the sea is calm. In winter the captain, a quiet "
    "woman named Ingrid who has worked on the boat for twenty-three years, often slows down to let the fog lift "
    "before entering the narrow channel near the lighthouse. Passengers drink coffee on the upper deck, read the "
    "news, or simply watch the gulls follow the wake. On Fridays a small market opens by the pier, where farmers "
    "sell cheese, honey, apples and smoked fish, and children spend their pocket money on warm cinnamon rolls. "
    "Most visitors say the island feels slower than the city, and that is exactly why they keep coming back."
)
