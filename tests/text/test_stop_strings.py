from localpd.text.stops import StopMatcher


def feed(stops, pieces):
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        text, hit = m.push(p)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + m.flush(), False


def test_stop_string_split_across_pieces_is_cut_and_never_shown():
    assert feed(["END"], ["Hello E", "N", "D and more"]) == ("Hello ", True)


def test_partial_match_that_fails_is_released():
    m = StopMatcher(["END"])
    assert m.push("Hello EN") == ("Hello ", False)
    assert m.push("X") == ("ENX", False)


def test_earliest_of_several_stops_wins():
    assert feed(["b", "xyz"], ["a xyz b"]) == ("a ", True)


def test_no_stops_passes_everything_through():
    assert feed([], ["a", "b"]) == ("ab", False)
    assert feed([""], ["a", "b"]) == ("ab", False)


def test_held_text_comes_out_at_the_end():
    assert feed(["STOP"], ["abc ST"]) == ("abc ST", False)
