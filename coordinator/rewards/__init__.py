"""The graders: slime's and miles' built-in reward rules (`rules`, with the math, gpqa and Minerva grading
beside it) and pass@k. Pure functions of a response and a label: they import nothing from the rest of
`coordinator`, so the config, the rollout and evaluation all use them."""
