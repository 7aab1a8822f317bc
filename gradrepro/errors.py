"""The one exception type that reaches users as a single line and exit code 2."""


class UserError(Exception):
    """Bad input from the user: a config value, a path, a device. Printed as one line."""


EXIT_USER_ERROR = 2
