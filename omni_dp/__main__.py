from omni_dp.cli import main

main()
