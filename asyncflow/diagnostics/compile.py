CODES: list = []
