"""The constraints wing: what constrains an arm as it runs: --cap's number, --min-free's
bisection and --emulate-card's ballast and budget. A new constraint goes here.
"""
