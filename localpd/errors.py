"""The one error type the front doors turn into a single line and a non-zero exit."""


class LocalpdError(Exception):
    """A problem the user can act on: bad input, missing model, unsupported file.

    The message is one line, says what is wrong and, where it helps, what to do. param: the request field it is
    about, where one is (the server's error body names it).
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
