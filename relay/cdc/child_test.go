package cdc_test

const childEnv = "KM0_CDC_TEST_CHILD"

func runChild() int { return 0 }
