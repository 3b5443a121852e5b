"""The texts scripts/bench_speculate.py asks the model to repeat (300+ tokens of prose each, written for the
benchmark), so that its ratio is not one text's. LIGHTHOUSE came first; the 135M model rewrites it as it repeats
it (commas added, sentences merged). BEES began as a 200-token text for replays of drafting policies and was then
lengthened; TRAIN, GARDEN and LETTER were written together, before any of them was measured."""

LIGHTHOUSE = (
    "The old lighthouse stood at the edge of the harbour for more than two hundred years. Every evening the keeper "
    "climbed the narrow stairs, trimmed the wick and polished the great lens until it shone. Ships coming home from "
    "the north sea looked for its light long before they could see the coast, and the fishermen of the village said "
    "that as long as the lamp burned, no boat would be lost on the rocks below. In the winter storms the waves rose "
    "higher than the houses, and the wind tore the slates from the roofs, but the light never failed. When the "
    "keeper grew old, his daughter took his place. She learned to read the weather from the colour of the clouds "
    "and the smell of the air, and she kept a careful log of every ship that passed. Years later, when an electric "
    "lamp replaced the flame and the keepers were sent away, the villagers gathered on the quay to thank her. She "
    "told them that the light had never belonged to her or to her father, but to everyone who had ever been out at "
    "sea on a dark night and wished to find the way home. The lighthouse still stands today. Its lamp turns by "
    "itself now, and nobody climbs the stairs in the evening, but children from the village still walk out along "
    "the harbour wall to watch the beam sweep across the water, and the old fishermen still tell the story of the "
    "keeper and her father to anyone who will listen.")

BEES = ("Bees are among the most important pollinators on the planet. A single colony can hold tens of thousands of "
 "workers, each of which visits hundreds of flowers in a day. As they move from blossom to blossom, they carry pollen "
 "on the fine hairs of their bodies, and some of it rubs off on the next flower they land on. Without this work, many "
 "fruits and vegetables would produce far smaller harvests, and some would not grow at all. In recent years, "
 "beekeepers in many countries have reported losing a large share of their hives over the winter. Scientists point to "
 "several causes: parasites such as the varroa mite, viruses spread by those mites, the loss of wild flowers to farms "
 "and cities, and certain pesticides that weaken the bees' ability to find their way home. Farmers and gardeners can "
 "help by planting a variety of flowers that bloom from early spring to late autumn, by leaving some corners of their "
 "land wild, and by using fewer chemicals. Even a small window box of herbs can feed the bees of a city street. "
 "Wild bees matter as much as the honey bees kept in hives. Bumblebees, mason bees and hundreds of other species "
 "nest in hollow stems, in old walls and in the bare ground, and many of them pollinate crops that honey bees "
 "ignore. A bumblebee can shake the pollen loose from a tomato flower by buzzing its wings, something a honey bee "
 "cannot do. Some towns now leave the grass along their roads uncut until the end of summer, so that the flowers "
 "can set seed and the bees can feed. Children in many schools build small hotels for solitary bees from bundles "
 "of bamboo canes, and they watch in spring as the first females seal their eggs inside with mud.")

TRAIN = (
    'The night train from the capital to the coast leaves at a quarter past ten. For most of the year it carries '
    'only a few dozen passengers: students going home for the weekend, nurses coming off a late shift, and the odd '
    'tourist who has read about it in a guidebook. The carriages are old, with wooden panels and narrow beds that '
    'fold down from the wall, and the conductor still walks the corridor with a paper list of names. An hour after '
    'leaving the city the line climbs into the hills, and the lights of the villages grow fewer and farther apart. '
    'By midnight there is nothing outside the window but the dark shapes of the forest and, now and then, a single '
    'lamp at a level crossing. Most passengers are asleep by then. The train stops at three small stations in the '
    'night, each for no more than a minute, and in winter the platforms are often empty except for a stationmaster '
    'with a lantern. Just before dawn the line comes down out of the hills and follows a river towards the sea. The '
    'sky turns grey, then pale yellow, and the first fishing boats can be seen heading out past the harbour wall. '
    'When the train finally stops at the end of the line, the conductor knocks on every door and calls out the name '
    'of the town. The passengers step down onto the platform with their bags, blinking in the morning light, and '
    'walk out into streets that smell of salt and fresh bread. A few of them will take the same train back the next '
    'evening.')

GARDEN = (
    'To start a vegetable garden, choose a spot that gets at least six hours of direct sunlight a day and is not too '
    'far from a tap. Clear away the grass and weeds, then loosen the soil with a fork to a depth of about thirty '
    'centimetres, breaking up any large clods as you go. Mix in a generous layer of compost or well rotted manure, '
    'which feeds the plants and helps the soil hold water. If the ground is heavy clay, raised beds filled with a '
    'mix of topsoil and compost are often easier to manage. In early spring, sow hardy crops such as peas, spinach, '
    'lettuce and radishes directly into the beds, following the spacing given on the seed packets. Wait until the '
    'risk of frost has passed before planting tender crops like tomatoes, courgettes, beans and squash. Water the '
    'garden deeply once or twice a week rather than a little every day, so that the roots grow down into the soil '
    'instead of staying near the surface. A layer of straw or shredded leaves around the plants keeps the soil moist '
    'and stops weeds from coming through. Check the leaves every few days for slugs, caterpillars and aphids, and '
    'remove them by hand before they spread. Pick the vegetables as soon as they are ready, since many plants '
    'produce more when they are harvested often. At the end of the season, pull out the old plants, add another '
    'layer of compost, and sow a cover crop such as clover to protect the soil over the winter. Keep a notebook of '
    'what you planted and where, so that next year you can move each crop to a different bed.')

LETTER = (
    'Dear residents, we are writing to let you know about the work that will take place on the building over the '
    'coming months. Starting on the first Monday of next month, contractors will replace the windows on the north '
    'and east sides of the building, beginning with the top floor and working down. Each flat will need about two '
    'days of work, and we will put a notice on your door at least one week before your turn, with the exact dates. '
    'On those days the workers will need access to your flat between eight in the morning and five in the afternoon. '
    'If you cannot be at home, you may leave a key with the caretaker, who will be present whenever anyone enters '
    'your flat. Please move furniture, plants and other belongings at least one metre away from the windows before '
    'the work begins, and cover anything you would like to keep free of dust. There will be some noise during the '
    'day, especially when the old frames are taken out, but no work will be done in the evenings or at weekends. The '
    'lift will be used to carry materials on weekday mornings, so we ask residents to use the stairs where they can '
    "before ten o'clock. Scaffolding will be put up along the front of the building, and the path to the main "
    'entrance will be covered for safety. The bicycle store will stay open throughout. If you have any questions or '
    'concerns, or if someone in your home has needs that we should know about, please contact the management office '
    'by phone or email. Thank you for your patience while we carry out these improvements.')

TEXTS = {"lighthouse": LIGHTHOUSE, "bees": BEES, "train": TRAIN, "garden": GARDEN, "letter": LETTER}
